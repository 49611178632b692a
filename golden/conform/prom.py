"""Prometheus /metrics text -> the server's speculative-decoding counters, and tau over a window.

Counters read (summed over every label set, so a multi-engine server is summed):

- refengine (docs/SERVING.md, Metrics): the histogram `refengine_spec_accepted_length` (committed length per
  verify step): `_sum` = committed tokens, `_count` = verify steps; tau = d(sum) / d(count).
  refengine's `refengine_spec_span_policy{policy="adaptive"}` says spans are chosen per step (`--speculation
  adaptive`, some steps decoded plainly: `refengine_spec_span_steps_total{span="1"}`): that tau is the policy's,
  not the drafter's (the check skips, saying so).
- vLLM (https://docs.vllm.ai/en/stable/usage/metrics.html, SpecDecodingProm): counters
  `vllm:spec_decode_num_drafts_total` and `vllm:spec_decode_num_accepted_tokens_total`;
  tau = 1 + d(accepted) / d(drafts) (the bonus token counted, as refengine's committed length is).
- SGLang (https://docs.sglang.io/references/production_metrics.html): only a running average (gauge
  `sglang:spec_accept_length`), which cannot be windowed: reported, the gate is skipped with that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REFENGINE_HIST = "refengine_spec_accepted_length"
REFENGINE_SPAN_STEPS, REFENGINE_SPAN_POLICY = "refengine_spec_span_steps_total", "refengine_spec_span_policy"
VLLM_DRAFTS, VLLM_ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"


def parse_samples(text: str) -> dict[str, float]:
    """Metric name (labels dropped) -> the sum of its samples. Comment and malformed lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def labelled_sum(text: str, name: str, label: str, value: str) -> float:
    """The sum of metric `name`'s samples whose `label` is `value` (0.0 when there are none)."""
    want, total = f'{label}="{value}"', 0.0
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(name + "{") and want in line.partition("{")[2].rsplit("}", 1)[0].split(","):
            try:
                total += float(line.rsplit("}", 1)[1].split()[0])
            except (IndexError, ValueError):
                continue
    return total


def server_kind(text: str | None) -> str:
    """refengine, vllm, sglang or unknown, from the metric names a /metrics page carries."""
    if text is None:
        return "unknown"
    for prefix, kind in (("refengine_", "refengine"), ("vllm:", "vllm"), ("sglang:", "sglang")):
        if any(line.startswith(prefix) for line in text.splitlines()):
            return kind
    return "unknown"


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative (committed tokens, verify steps) at one instant; None fields: the server has no counters."""

    kind: str
    committed: float | None
    steps: float | None
    average: float | None = None  # SGLang's running average, when that is all there is
    plain_steps: float = 0.0  # refengine: request-steps the span policy decoded plainly (span 1)
    adaptive: bool = False  # refengine: the span policy chooses spans per step

    @classmethod
    def read(cls, text: str | None) -> SpecCounters:
        kind = server_kind(text)
        s = parse_samples(text or "")
        if kind == "refengine" and f"{REFENGINE_HIST}_count" in s:
            plain = labelled_sum(text or "", REFENGINE_SPAN_STEPS, "span", "1")
            adaptive = labelled_sum(text or "", REFENGINE_SPAN_POLICY, "policy", "adaptive") > 0
            committed, steps = s.get(f"{REFENGINE_HIST}_sum", 0.0), s[f"{REFENGINE_HIST}_count"]
            return cls(kind, committed, steps, plain_steps=plain, adaptive=adaptive)
        if kind == "vllm" and VLLM_DRAFTS in s:
            drafts = s[VLLM_DRAFTS]
            return cls(kind, drafts + s.get(VLLM_ACCEPTED, 0.0), drafts)
        return cls(kind, None, None, s.get(SGLANG_ACCEPT_LENGTH))


@dataclass(frozen=True)
class TauWindow:
    """tau between two readings, or why there is none (`reason`)."""

    tau: float | None
    steps: float
    committed: float
    reason: str = ""
    plain_steps: float = 0.0  # of `steps`, those a span policy decoded plainly (refengine, span 1)
    adaptive: bool = False  # refengine's span policy chose spans per step


def tau_between(before: SpecCounters, after: SpecCounters) -> TauWindow:
    if after.committed is None or after.steps is None or before.committed is None or before.steps is None:
        avg = f" (running average {after.average})" if after.average is not None else ""
        return TauWindow(None, 0, 0, f"{after.kind} server exports no windowable speculative counters{avg}")
    steps, committed = after.steps - before.steps, after.committed - before.committed
    if steps <= 0:
        return TauWindow(None, steps, committed, "no verify steps during the run: the server is not speculating")
    plain = after.plain_steps - before.plain_steps
    return TauWindow(committed / steps, steps, committed, plain_steps=plain, adaptive=after.adaptive)
