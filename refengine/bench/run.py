"""Running bench rows: one engine per mode (plain, dflash, adaptive), each concurrency and acceptance profile
`repeats` times after a discarded warm-up, every step timed on the host.

Per-step columns (ms, per step of that kind):
- decode / draft / verify: the runner's GPU-synchronised timings (runner.timings) over the steps that ran them
  (draft and verify per verify step: a DFlash step is one draft + one verify);
- host: the wall time of engine.step() minus the runner's synchronised compute, over all steps: scheduling,
  commit, acceptance, and the Python between phases (batch tensors are built inside the runner's timed part).
- by step kind (JSON only): `<kind>_steps` and `<kind>_wall_ms`, the steps of each plan kind in a run and
  their wall time (prefill, decode: plain decode's own step, decode_taps: a span-1 step of speculating
  requests that writes their tap features, verify), so a difference between two modes can be placed.
Ratios: x_plain_floor = tok/s / (copy bandwidth / target weight bytes), the memory-bound floor of a batch-1
plain decode step; x_own_ideal (DFlash) = per-request tok/s / (tau * bandwidth / (target + drafter bytes)),
i.e. against a step that streams both models' weights once and commits tau tokens.
`spans` (speculating rows): the engine's span policy record (Engine.span_stats: the policy, verify span chosen
-> request-steps and choices that raised, counted over the run; the policy's own statistics). A run in which a
policy choice raised fails (BenchError): those steps decoded plainly, so the row would not measure the policy.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

from refengine.bench.floors import sync_device
from refengine.bench.job import steady_budgets
from refengine.bench.report import throughput_fields
from refengine.errors import RefEngineError
from refengine.plan import PLAN_KINDS, plan_kind
from refengine.request import SamplingParams, SpecStats
from refengine.spec_decode.acceptance_profile import AcceptanceOverride


class BenchError(RefEngineError):
    """A bench run is not a measurement: a request was rejected, a row ran no tokens, or a span policy's choice
    raised; or the bench was asked for something it cannot measure."""


def check_ran(reqs: list, output_tokens: int | list[int]) -> None:
    """Every request ran its whole budget (ignore_eos; `output_tokens`: one for all, or each request's): a row
    with an errored, aborted or short request is not a measurement."""
    if not reqs or sum(len(r.output_ids) for r in reqs) == 0:
        raise BenchError(f"a bench run of {len(reqs)} requests produced no tokens")
    budgets = output_tokens if isinstance(output_tokens, list) else [output_tokens] * len(reqs)
    for r, budget in zip(reqs, budgets):
        if len(r.output_ids) < budget:
            reason = r.finish_reason.value if r.finish_reason is not None else "unfinished"
            raise BenchError(
                f"bench request {r.request_id} ran {len(r.output_ids)} of {budget} tokens "
                f"({reason}) {r.message}".rstrip()
            )


def run_once(
    engine, prompts: list[list[int]], output_tokens: int, in_flight: int | None = None, temperature: float = 0.0
) -> dict[str, Any]:
    """Submit every prompt together (`in_flight` None: a wave), or keep `in_flight` of them running, the next
    one submitted as one finishes (steady arrivals: ARRIVALS; the first in flight with budgets spread over
    (0, output_tokens], job.steady_budgets); step to completion timing each step; fail on rejection / no
    tokens. `temperature` > 0 samples, request i seeded i (the same draws every run)."""
    device = str(engine.target.device)
    n = len(prompts)
    budgets = [output_tokens] * n if in_flight is None else steady_budgets(n, in_flight, output_tokens)
    t_before, plans_before = dict(engine.runner.timings), Counter(engine.scheduler.plan_counts)
    spans_before = engine.span_stats()
    queue = [
        (p, SamplingParams(max_tokens=b, ignore_eos=True, temperature=temperature, seed=i))
        for i, (p, b) in enumerate(zip(prompts, budgets))
    ]
    reqs: list = []
    running: list = []  # steady arrivals: the submitted requests not yet finished

    def submit(n: int) -> None:
        new = [engine.add_request(p, params) for p, params in queue[:n]]
        del queue[:n]
        bad = [r for r in new if r.reject_reason is not None]
        if bad:
            raise BenchError(
                f"{len(bad)} of {len(new)} bench requests were rejected ({bad[0].reject_reason.value}): "
                f"{bad[0].message}"
            )
        reqs.extend(new)
        running.extend(new)

    sync_device(device)
    t0 = time.perf_counter()
    submit(len(queue) if in_flight is None else in_flight)
    step_wall = 0.0
    kinds: Counter = Counter()  # plan kind -> steps
    kind_wall: dict[str, float] = dict.fromkeys(PLAN_KINDS, 0.0)  # plan kind -> wall seconds of its steps
    while engine.has_work():
        ts = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - ts
        step_wall += dt
        if engine.last_plan is not None:
            kind = plan_kind(engine.last_plan)
            kinds[kind] += 1
            kind_wall[kind] += dt
        if in_flight is not None and queue:  # steady arrivals: as many new requests as finished (host work)
            running[:] = [r for r in running if not r.finished]
            submit(in_flight - len(running))
    sync_device(device)
    secs = time.perf_counter() - t0
    timings = {k: engine.runner.timings[k] - t_before.get(k, 0.0) for k in engine.runner.timings}
    plans = Counter(engine.scheduler.plan_counts)
    plans.subtract(plans_before)
    check_ran(reqs, budgets)
    spans = run_span_stats(spans_before, engine.span_stats())
    if spans["errors"]:
        raise BenchError(
            f"the {spans['policy']} span policy's choice raised {spans['errors']} times in this run (those steps "
            "decoded plainly; the engine logged each): a bug, and the row would not measure the policy"
        )
    tokens = sum(len(r.output_ids) for r in reqs)
    stats = SpecStats()
    for r in reqs:
        stats.merge(r.spec)
    compute = sum(timings.get(k, 0.0) for k in ("prefill_s", "decode_s", "draft_s", "verify_s"))
    return {
        "tokens": tokens,
        "seconds": secs,
        "timings": timings,
        "plans": dict(plans),
        "stats": stats,
        "host_s": max(step_wall - compute, 0.0),
        "steps": sum(plans.values()),
        "kind_steps": kinds,
        "kind_wall_s": kind_wall,
        "spans": spans,
    }


def run_span_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's share of Engine.span_stats(): `spans` (verify span chosen -> request-steps) and `errors` (policy
    choices that raised) counted over the run alone, `policy` and `detail` (the policy's own cumulative
    statistics) as after it."""
    spans = Counter({k: int(v) for k, v in after["spans"].items()})
    spans.subtract({k: int(v) for k, v in before["spans"].items()})
    return {
        "policy": after["policy"],
        "spans": {k: v for k, v in sorted(spans.items(), key=lambda kv: int(kv[0])) if v},
        "errors": int(after["errors"]) - int(before["errors"]),
        "detail": after["detail"],
    }


def measure_row(
    engine,
    mode: str,
    acceptance: str,
    prompts: list[list[int]],
    output_tokens: int,
    floor: float,
    own_bytes: int,
    bandwidth: float,
    in_flight: int | None = None,
    temperature: float = 0.0,
) -> dict[str, Any]:
    r = run_once(engine, prompts, output_tokens, in_flight, temperature)
    c, secs, t, plans = in_flight or len(prompts), r["seconds"], r["timings"], r["plans"]
    row: dict[str, Any] = {
        "mode": mode,
        "acceptance": acceptance,
        **throughput_fields(r["tokens"], secs, c, floor),
        "host_ms_per_step": round(r["host_s"] * 1e3 / max(r["steps"], 1), 4),
        "prefill_ms": round(t["prefill_s"] * 1e3, 3),  # the run's prefill steps together (part of its seconds)
        "steps": r["steps"],
    }
    for kind in PLAN_KINDS:  # where the run's wall time went, by step kind (decode_taps: adaptive's span-1 steps
        if r["kind_steps"][kind]:  # that still write tap features; decode: plain decode's own step)
            row[f"{kind}_steps"] = r["kind_steps"][kind]
            row[f"{kind}_wall_ms"] = round(r["kind_wall_s"][kind] * 1e3, 3)
    if plans.get("decode"):
        row["decode_ms_per_step"] = round(t["decode_s"] * 1e3 / plans["decode"], 4)
    if mode != "plain":
        s: SpecStats = r["stats"]
        n = max(plans.get("verify", 0), 1)
        ideal = s.tau * bandwidth / own_bytes
        row.update(
            tau=round(s.tau, 4),
            verify_steps=plans.get("verify", 0),
            draft_ms_per_step=round(t["draft_s"] * 1e3 / n, 4),
            verify_ms_per_step=round(t["verify_s"] * 1e3 / n, 4),
            own_ideal_tok_per_s=round(ideal, 1),
            x_own_ideal=round(r["tokens"] / secs / c / ideal, 4) if ideal else None,
            accepted_hist={str(k): v for k, v in sorted(s.accepted_hist.items())},
            span_hist={str(k): v for k, v in sorted(s.span_hist.items())},
        )
        row["spans"] = r["spans"]  # the span policy's record (Engine.span_stats), this run's counts
    return row


def engine_for(
    mode: str,
    target: str,
    draft: str | None,
    *,
    device: str,
    synthetic: bool,
    max_num_seqs: int,
    max_model_len: int,
    override: AcceptanceOverride | None,
    graph_mode: str | None = None,
    num_blocks: int | None = None,
    shared_target: Any = None,
    draft_sampling: str = "sampled",
    fused_ops: tuple[str, ...] | None = None,
):
    from refengine.config import EngineConfig
    from refengine.engine import Engine

    cfg = EngineConfig(
        target,
        draft_path=draft if mode != "plain" else None,
        device=device,
        synthetic_weights=synthetic,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        speculation="adaptive" if mode == "adaptive" else "fixed",
        graph_mode=graph_mode,
        num_blocks=num_blocks,
        draft_sampling=draft_sampling,
        fused_ops=fused_ops,
    )
    return Engine(cfg, acceptance_override=override if mode != "plain" else None, target=shared_target)


def set_override(engine, override: AcceptanceOverride | None) -> None:
    """Swap the engine's acceptance profile between rows (bench only: the engine's own path never does)."""
    engine.scheduler.acceptance_override = override


def row_label(mode: str, override: AcceptanceOverride | None, synthetic: bool) -> str:
    if override is not None and mode != "plain":
        return override.label
    return "-" if mode == "plain" else ("chance (synthetic weights)" if synthetic else "real drafter")


def settle_engine(engine, batch: list[list[int]], seconds: float, tokens: int, in_flight: int | None = None) -> None:
    """Load the device for `seconds` (untimed runs of `batch`, as run_once submits them: a wave, or `in_flight`
    at a time) so the first measured row meets its sustained clocks. Each run generates `tokens`, the measured
    runs' length: the adaptive policy learns from these runs, and runs shorter than the measured ones would teach
    it their generations' early blocks only (the trained tiny pair's text loops come later)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        run_once(engine, batch, tokens, in_flight)


def print_profile(engine, prompts, new_tokens: int, label: str) -> None:
    """Where the time of one short run goes: torch.profiler's top ops, to stderr (not part of the timings)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.target.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run_once(engine, prompts, new_tokens)
    events = prof.key_averages()
    print(f"\n--- profile: {label}, {new_tokens} new tokens ---", file=sys.stderr)
    for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        print(events.table(sort_by=key, row_limit=12, max_name_column_width=48), file=sys.stderr)
