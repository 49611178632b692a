"""The `sampling` check of `golden conform`: seeded sampled completions over HTTP, gated by the distribution
gate (golden/distribution/gate.py) against the oracle's conditionals computed live through HF.

What is sent: the pair's golden prompts (the greedy goldens' prompts the other checks use), cycled, one
/v1/completions request each with `temperature` / `top_p` / `top_k` from the plan (`top_k` only when on:
it is vLLM's field, not OpenAI's), a distinct `seed` per request (plan seed + request index),
`max_tokens` = the plan's, `return_token_ids: true` (vLLM >= 0.10.2's field: the sampled ids come back as
`choices[0].token_ids`), and no `logprobs`, so a speculative server speculates (refengine decodes a request
that asks for logprobs plainly). They go `concurrency` at a time (one batch window each, as in the
concurrency check's bursts). How many: the gate needs ks_sample_size() pooled positions (5119: a
Kolmogorov distance of 0.05 detected with power 0.99 at alpha 1e-3), so the first round is
ceil(5119 / max_tokens) requests (40 at max_tokens 128); answers that end early (EOS) leave fewer
positions, and further rounds of ceil(missing / mean length so far) requests follow, up to
MAX_REQUEST_FACTOR times the first round (then the check skips, saying how short it fell).

Each answer becomes a SampleRecord (prompt, the returned token_ids, the request's seed); HF teacher-forces
each one (golden/hf_sampling.py hf_conditionals, the scorer the regret gates use: --hf-model, its dtype
and device) into ConditionalRecords under the same SamplingConfig, and distribution_gate pools the
randomized PIT of every sampled position: KS and chi-square at alpha 1e-3 each, and no sampled token
outside the oracle's top-k / top-p set.

Answers ending at EOS (finish_reason "stop") are kept as they are, and `ignore_eos` is not sent by default:
a continuation's PIT value at position i is U(0, 1) given everything before it, and whether position i is
observed at all (no EOS before it, i < max_tokens) is decided by the tokens before it, so the observed
values stay i.i.d. U(0, 1) however early a sample stops (the EOS token itself is a sampled position and is
gated too); so are the extra rounds, which depend only on earlier answers. `ignore_eos` (the plan's flag,
`--sampling-ignore-eos`) only buys positions per request, and not every server has it.

Why `token_ids` and not the text: re-tokenizing the text gives the canonical tokenization, which is not
always the sampled one (a sampler can emit " a" + "b" where the tokenizer reads " ab"); the PIT of the
wrong ids is biased. A server whose answers have no `token_ids` is skipped, saying so.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from golden.conform.checks import FAIL, PASS, SKIP, CheckResult
from golden.conform.client import Server, run_concurrently
from golden.conform.parse import ResponseError
from golden.conform.prom import SpecCounters
from golden.conform.source import GoldenSource
from golden.distribution.gate import DistributionReport, distribution_gate
from golden.distribution.processing import SamplingConfig
from golden.distribution.records import ConditionalRecord, SampleRecord
from golden.distribution.stats import ks_sample_size
from golden.errors import GoldenError

MAX_REQUEST_FACTOR = 8  # requests in all, at most this many times the first round
DEFAULT_MAX_TOKENS = 128
DEFAULT_CONCURRENCY = 16

# (source, samples, cfg) -> the oracle's conditionals; golden/hf_sampling.py by default (tests may pass another)
Oracle = Callable[[GoldenSource, list[SampleRecord], SamplingConfig], list[ConditionalRecord]]


class NoTokenIds(GoldenError):
    """The server's answer has no `choices[0].token_ids`: it does not implement vLLM's `return_token_ids`."""


@dataclass(frozen=True)
class SamplingPlan:
    cfg: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = DEFAULT_MAX_TOKENS
    concurrency: int = DEFAULT_CONCURRENCY
    seed: int = 0  # request i is seeded seed + i
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise GoldenError(f"--sampling-max-tokens must be >= 1, got {self.max_tokens}")
        if self.concurrency < 1:
            raise GoldenError(f"--sampling-concurrency must be >= 1, got {self.concurrency}")
        if not 0 <= self.seed < 2**63:
            raise GoldenError(f"--sampling-seed must be in 0..2**63 - 1, got {self.seed}")

    @property
    def positions(self) -> int:
        """Pooled positions the gate needs (its powered sample size)."""
        return ks_sample_size()

    @property
    def first_round(self) -> int:
        """Requests that reach `positions` when every answer runs to max_tokens."""
        return math.ceil(self.positions / self.max_tokens)

    def body(self, prompt: list[int], seed: int) -> dict:
        c = self.cfg
        body: dict = {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "seed": seed,
            "return_token_ids": True,
        }
        if c.top_k:
            body["top_k"] = c.top_k
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def sampled_ids(resp: dict, prompt: list[int]) -> tuple[list[int], str]:
    """(choices[0].token_ids, finish_reason); NoTokenIds when the answer has none, ResponseError when they
    cannot be read or the echoed prompt_token_ids are not the prompt sent."""
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ResponseError(f"answer has no choices: {str(resp)[:200]}")
    c = choices[0]
    ids = c.get("token_ids")
    if ids is None:
        raise NoTokenIds(f"the answer has no choices[0].token_ids (keys: {sorted(c)})")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ResponseError(f"choices[0].token_ids must be a non-empty list of token ids, got {str(ids)[:200]}")
    echoed = c.get("prompt_token_ids")
    if echoed is not None and echoed != prompt:
        raise ResponseError(f"prompt_token_ids {str(echoed)[:120]} are not the prompt sent {str(prompt)[:120]}")
    return ids, str(c.get("finish_reason"))


def hf_oracle(src: GoldenSource, samples: list[SampleRecord], cfg: SamplingConfig) -> list[ConditionalRecord]:
    import torch

    from golden.hf_sampling import hf_conditionals

    return hf_conditionals(src.hf_model, samples, cfg, getattr(torch, src.dtype), src.device)


@dataclass
class SampledRun:
    samples: list[SampleRecord] = field(default_factory=list)
    finish: Counter = field(default_factory=Counter)
    rounds: int = 0

    @property
    def positions(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)


def sample(server: Server, src: GoldenSource, plan: SamplingPlan) -> SampledRun:
    """Rounds of seeded requests until the pooled positions reach plan.positions or the request cap. Request 0
    goes alone first: a server without token_ids is told apart before any more are sent."""
    run = SampledRun()

    def send(batch: list[int]) -> None:
        recs = [src.greedy[i % len(src.greedy)] for i in batch]
        bodies = [plan.body(r.prompt_ids, plan.seed + i) for r, i in zip(recs, batch)]
        answers = [server.complete(bodies[0])] if len(bodies) == 1 else run_concurrently(server, bodies)
        for r, i, resp in zip(recs, batch, answers):
            ids, finish = sampled_ids(resp, r.prompt_ids)
            run.samples.append(SampleRecord(f"{r.name}/sample{i}", r.prompt_ids, ids, plan.seed + i))
            run.finish[finish] += 1

    send([0])
    cap, want = MAX_REQUEST_FACTOR * plan.first_round, plan.first_round - 1
    while run.positions < plan.positions and len(run.samples) < cap:
        todo = list(range(len(run.samples), min(cap, len(run.samples) + want)))
        for b in range(0, len(todo), plan.concurrency):
            send(todo[b : b + plan.concurrency])
        run.rounds += 1
        mean = run.positions / len(run.samples)
        want = math.ceil(max(0, plan.positions - run.positions) / mean)
    return run


def _summary(plan: SamplingPlan, run: SampledRun, rep: DistributionReport, steps: float | None) -> str:
    c, u = plan.cfg, rep.uniformity
    finishes = ", ".join(f"{k} {v}" for k, v in sorted(run.finish.items()))
    spec = "no speculative counters" if steps is None else f"{steps:.0f} verify steps during the run"
    return (
        f"{len(run.samples)} requests ({run.rounds} rounds; finish {finishes}) at T {c.temperature:g}, top-p "
        f"{c.top_p:g}, top-k {c.top_k}, max_tokens {plan.max_tokens}, "
        f"seeds {plan.seed}..{plan.seed + len(run.samples) - 1}"
        f"{', ignore_eos' if plan.ignore_eos else ''}: {u.n} positions (powered for >= {rep.min_positions}); "
        f"KS D = {u.ks:.4f} (p {u.ks_p:.3g}), chi-square {u.chi2:.1f} on {len(u.counts) - 1} df (p {u.chi2_p:.3g}), "
        f"alpha {u.alpha:g}; impossible tokens {len(rep.impossible)}; {spec}"
    )


def check_sampling(server: Server, src: GoldenSource, plan: SamplingPlan, oracle: Oracle = hf_oracle) -> CheckResult:
    before = SpecCounters.read(server.metrics())
    try:
        run = sample(server, src, plan)
    except NoTokenIds as e:
        return CheckResult(
            "sampling",
            SKIP,
            f"{e}: the check needs the sampled token ids (vLLM's `return_token_ids`, vLLM >= 0.10.2); re-tokenizing "
            "the text would bias the PIT with non-canonical tokenizations",
        )
    after = SpecCounters.read(server.metrics())
    steps = None if after.steps is None or before.steps is None else after.steps - before.steps
    if run.positions < plan.positions:
        return CheckResult(
            "sampling",
            SKIP,
            f"{len(run.samples)} requests (max_tokens {plan.max_tokens}) gave {run.positions} positions, fewer than "
            f"the {plan.positions} the gate needs (finish {dict(run.finish)}): raise --sampling-max-tokens or "
            "send --sampling-ignore-eos",
            data={"requests": len(run.samples), "positions": run.positions},
        )
    vocab = json.loads((src.hf_model / "config.json").read_text()).get("vocab_size")
    for smp in run.samples:
        if vocab is not None and max(smp.output_ids) >= vocab:
            raise ResponseError(f"{smp.name}: token id {max(smp.output_ids)} outside the scorer's vocabulary ({vocab})")
    rep = distribution_gate(run.samples, oracle(src, run.samples, plan.cfg))
    u = rep.uniformity
    data = {
        "requests": len(run.samples),
        "rounds": run.rounds,
        "positions": u.n,
        "min_positions": rep.min_positions,
        "ks": u.ks,
        "ks_p": u.ks_p,
        "chi2": u.chi2,
        "chi2_p": u.chi2_p,
        "impossible": len(rep.impossible),
        "verify_steps": steps,
        "finish": dict(run.finish),
    }
    details = [] if rep.passed else str(rep).splitlines()
    return CheckResult("sampling", PASS if rep.passed else FAIL, _summary(plan, run, rep, steps), details, data)
