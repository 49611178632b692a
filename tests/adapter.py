"""The bridge between refengine and golden: run the engine and emit golden's plain records.

Tests are the only place that imports both packages; the same records could come from any engine (JSONL).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from golden.records import AcceptanceRecord, TopKRecord
from refengine import Engine, EngineConfig, Request, SamplingParams
from refengine.defaults import fused_ops_arg


def cpu_engine(target, draft=None, proposer=None, span_policy=None, **kw) -> Engine:
    """fp32 on the CPU with the torch attention backend. `proposer` replaces the DFlash lane (test proposers);
    `span_policy` the one `speculation` names (tests/span_policies.py)."""
    return Engine(
        EngineConfig(str(target), draft_path=str(draft) if draft else None, device="cpu", **kw),
        proposer=proposer,
        span_policy=span_policy,
    )


def gpu_engine(target, draft=None, proposer=None, shared_target=None, span_policy=None, **kw) -> Engine:
    """bf16 on CUDA with the FlashInfer backend. The tiny pairs get a fixed pool of 8192 blocks (131k tokens,
    plenty) instead of one planned to fill the device: the checks after every step stay cheap. The memory
    tests build their engines themselves to exercise the planner."""
    kw.setdefault("num_blocks", 8192)
    # the whole GPU suite runs in one graph mode per invocation: REFENGINE_GRAPH_MODE=eager|piecewise|full
    kw.setdefault("graph_mode", os.environ.get("REFENGINE_GRAPH_MODE") or None)
    # and one set of fused kernels: REFENGINE_FUSED_OPS=rmsnorm,add_rmsnorm,silu_and_mul,rope,pre_attn (or none)
    fused = os.environ.get("REFENGINE_FUSED_OPS")
    if fused is not None:
        kw.setdefault("fused_ops", fused_ops_arg(fused))
    return Engine(
        EngineConfig(
            str(target),
            draft_path=str(draft) if draft else None,
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            **kw,
        ),
        proposer=proposer,
        target=shared_target,
        span_policy=span_policy,
    )


def sampled_params(cfg, n: int, seed: int, max_tokens: int) -> list[SamplingParams]:
    """n requests' SamplingParams under golden's SamplingConfig `cfg` (temperature, top-k, top-p), request i
    seeded seed * 10_000 + i, every one `max_tokens` long (ignore_eos: the distribution gate's positions)."""
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=seed * 10_000 + i,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def score_sequences(engine: Engine, sequences: list[tuple[str, list[int], list[int]]], k: int = 8) -> list[TopKRecord]:
    """Teacher-force each (name, prompt, continuation) through Engine.score, all together: the prompt through
    prefill, the continuation through decode steps. One top-k row per position."""
    scored = engine.score([(prompt, cont) for _, prompt, cont in sequences], k)
    return [
        TopKRecord(
            name=name,
            token_ids=s.token_ids,
            topk_ids=[ids for ids, _ in s.topk],
            topk_logprobs=[lps for _, lps in s.topk],
        )
        for (name, _, _), s in zip(sequences, scored)
    ]


def greedy(
    engine: Engine, prompts: list[list[int]], max_tokens: list[int] | int, ignore_eos: bool = True
) -> list[list[int]]:
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=ignore_eos) for m in mts])
    for r in reqs:
        assert r.reject_reason is None, r.message
    return [r.output_ids for r in reqs]


def record_drafts(engine: Engine) -> list[list[list[int]]]:
    """Wrap engine.proposer.propose; the returned list fills with every draft step's proposals, in order."""
    log: list[list[list[int]]] = []
    propose = engine.proposer.propose

    def logged(items):
        out = propose(items)
        log.append(out)
        return out

    engine.proposer.propose = logged  # type: ignore[method-assign,union-attr]
    return log


def first_divergence(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_tokens(got: list[int], want: list[int], label: str) -> None:
    i = first_divergence(got, want)
    if i is not None:
        raise AssertionError(
            f"{label}: first divergence at output position {i} of {len(want)}: "
            f"got {got[max(0, i - 3) : i + 4]} want {want[max(0, i - 3) : i + 4]}"
        )


# ---- acceptance ------------------------------------------------------------------------------------------


def acceptance_record(name: str, req: Request) -> AcceptanceRecord:
    """A finished request as golden's AcceptanceRecord: output and tokens committed per verify step."""
    assert req.reject_reason is None, f"{name}: rejected: {req.message}"
    return AcceptanceRecord(name, list(req.prompt_ids), list(req.output_ids), list(req.spec.committed_per_step))


def run_requests(
    engine: Engine, items: list[tuple[list[int], SamplingParams]], stagger_after: int | None = None
) -> list[Request]:
    """Submit (prompt, params) items and run to completion. stagger_after=k: submit the first k together,
    run 3 steps, then submit the rest one per step while the first ones are mid-generation."""
    k = len(items) if stagger_after is None else stagger_after
    reqs = [engine.add_request(p, sp) for p, sp in items[:k]]
    if k < len(items):
        for _ in range(3):
            engine.step()
        for p, sp in items[k:]:
            reqs.append(engine.add_request(p, sp))
            engine.step()
    while engine.has_work():
        engine.step()
    return reqs


# ---- what the engine still holds: drafter contexts, KV tables, reservations (refactor fix-up point) ----


def engine_leftovers(engine: Engine) -> dict[str, object]:
    """Per-request state the engine still holds; all empty / zero once every request has finished."""
    lane, pool = engine.proposer, engine.pool
    contexts = sorted(lane.live_requests()) if lane is not None else []
    return {
        "drafter_contexts": contexts,
        "kv_block_tables": sorted(pool.allocator.owners()),
        "kv_lengths": sorted(pool.seq_len),
        "kv_lifetime_reservations": sorted(pool.lifetime_blocks),
        "blocks_not_free": pool.num_blocks - pool.allocator.num_free,
        "running": [r.request_id for r in engine.scheduler.running],
        "waiting": [r.request_id for r in engine.scheduler.waiting],
        "span_policy_requests": sorted(getattr(engine.span_policy, "live", ())),
    }


def assert_no_leftovers(engine: Engine, label: str = "") -> None:
    left = {k: v for k, v in engine_leftovers(engine).items() if v}
    if left:
        raise AssertionError(f"{label}: state outlived its requests: {left}")
    engine.check_integrity()


# ---- feature capture: every row handed to the drafter (refactor fix-up point) ----------------------------


class FeatureRecorder:
    """Wraps engine.proposer.append_pending_context and append_pending_step (every row the drafter receives
    is committed through one of them: prefill and verify rows, and the rows of decode steps at span 1)
    and reads the committed rows' features from the feature store right then (what the drafter will read);
    and engine.scheduler.schedule (to tag each batch of rows with the plan that produced it: 'PrefillPlan'
    with its request count, 'VerifyPlan' or 'DecodePlan')."""

    def __init__(self, engine: Engine):
        self.calls: list[tuple[int, int, torch.Tensor, str, int]] = []  # (req, first pos, rows, plan, plan size)
        self._plan: tuple[str, int] = ("none", 0)
        lane, scheduler = engine.proposer, engine.scheduler
        append, append_step, schedule = lane.append_pending_context, lane.append_pending_step, scheduler.schedule

        def recording_schedule():
            plan = schedule()
            if plan is not None:
                self._plan = (type(plan).__name__, len(plan.requests))
            return plan

        def recording_append(req_id, first_position, rows):
            feats = lane.store.read(req_id, first_position, first_position + rows).cpu()
            self.calls.append((req_id, first_position, feats, *self._plan))
            return append(req_id, first_position, rows)

        def recording_append_step(req_ids, starts):
            for req_id, start in zip(req_ids, starts):
                self.calls.append((req_id, start, lane.store.read(req_id, start, start + 1).cpu(), *self._plan))
            return append_step(req_ids, starts)

        lane.append_pending_context = recording_append
        lane.append_pending_step = recording_append_step
        scheduler.schedule = recording_schedule

    def rows(self, req_id: int) -> torch.Tensor:
        """Every row handed over for req_id, in position order (asserting they tile 0..n without gaps)."""
        parts = sorted((pos, f) for r, pos, f, _, _ in self.calls if r == req_id)
        at = 0
        for pos, f in parts:
            assert pos == at, f"request {req_id}: rows handed over from position {pos}, expected {at}"
            at += f.shape[0]
        return torch.cat([f for _, f in parts])

    def sources(self, req_id: int) -> list[tuple[int, int, str, int]]:
        """(first position, rows, plan kind, plan size) of every hand-over for req_id."""
        return [(pos, f.shape[0], kind, n) for r, pos, f, kind, n in self.calls if r == req_id]


# ---- deliberately broken engines: each breaks one mechanism a test guards (refactor fix-up point) --------


def break_tap_layers_off_by_one(engine: Engine) -> None:
    """Capture target layer L+1 wherever the drafter asks for layer L (the vLLM #42704 / #46435 class)."""
    engine.proposer.capture_layers = tuple(layer + 1 for layer in engine.proposer.capture_layers)


def break_rotate_batched_prefill_features(engine: Engine) -> None:
    """In a prefill of several requests, hand each request the rows of the next request in the batch, cut or
    padded (last row repeated) to its own row count, written over its rows in the feature store, so every
    alignment assert stays quiet."""
    runner, lane = engine.runner, engine.proposer
    execute = runner.execute

    def fit(f: torch.Tensor, n: int) -> torch.Tensor:
        return f[:n] if f.shape[0] >= n else torch.cat([f, f[-1:].expand(n - f.shape[0], -1)])

    def rotated(plan):
        result = execute(plan)
        staged = lane._staged  # white-box: (first position, rows) the runner staged for this plan
        ids = [r.request_id for r in plan.requests if r.request_id in staged]
        if type(plan).__name__ == "PrefillPlan" and len(ids) > 1:
            old = {i: lane.store.read(i, staged[i][0], staged[i][0] + staged[i][1]) for i in ids}
            for a, b in zip(ids, ids[1:] + ids[:1]):
                lane.store.put(a, staged[a][0], fit(old[b], staged[a][1]))
        return result

    runner.execute = rotated


def break_verify_features_shifted(engine: Engine) -> None:
    """After a verify, hand the drafter verify rows 1..m+1 instead of 0..m (the last row repeated when the
    whole span was accepted), written over the committed rows in the feature store: same row count, wrong
    rows."""
    lane = engine.proposer
    record = lane.record_verify_dflash_context

    def shifted(req_id, start, committed):
        _, n = lane._staged[req_id]  # white-box: this verify's staged rows
        rows = lane.store.read(req_id, start, start + n)
        lane.store.put(req_id, start, torch.cat([rows[1 : committed + 1], rows[n - 1 :]])[:committed])
        record(req_id, start, committed)

    lane.record_verify_dflash_context = shifted


def break_decode_step_rows_rotated(engine: Engine) -> None:
    """In a decode step of several drafting requests (every span 1), hand each request the
    next request's row of the step's features (rotated in the feature store): same shapes, wrong rows."""
    lane = engine.proposer
    stage_step = lane.stage_step

    def rotated(req_ids, starts):
        if len(req_ids) > 1:
            slots = torch.cat([lane.store.slots(r, p, p + 1) for r, p in zip(req_ids, starts)])
            lane.store.rows[slots] = lane.store.rows[slots].roll(-1, dims=0)
        return stage_step(req_ids, starts)

    lane.stage_step = rotated


def break_drop_ignore_eos(engine: Engine) -> None:
    """The engine drops SamplingParams.ignore_eos at submission (a server not forwarding the flag)."""
    add = engine.add_request
    engine.add_request = lambda prompt, params=None, **kw: add(
        prompt, dataclasses.replace(params or SamplingParams(), ignore_eos=False), **kw
    )


def break_first_token_from_first_row(engine: Engine) -> None:
    """A prefill that scored several rows (prompt_logprobs) takes the first generated token from the first
    scored row instead of the last."""
    runner = engine.runner
    execute = runner.execute

    def first_row(plan):
        result = execute(plan)
        if type(plan).__name__ == "PrefillPlan":
            result.argmax[:] = [rows[:1] * len(rows) for rows in result.argmax]  # as many rows, the first's value
        return result

    runner.execute = first_row


def break_starve_plain_requests(engine: Engine) -> None:
    """The scheduler always prefers a verify plan while any request speculates (plain requests wait)."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def verify_first():
        scheduler._verify_turn = True
        return schedule()

    scheduler.schedule = verify_first


def break_never_release_drafter_context(engine: Engine) -> None:
    """Finished requests keep their drafter context (K/V buffers and pending features)."""
    engine.proposer.release = lambda req_id: None


def break_mask_token_is_last_vocab_row(engine: Engine) -> None:
    """The drafter fills its block with vocab_size - 1 instead of the configured MASK id (right by accident
    on any drafter whose MASK is the last row)."""
    engine.drafter.cfg = dataclasses.replace(engine.drafter.cfg, mask_token_id=engine.target.cfg.vocab_size - 1)


def break_rotate_batched_drafts(engine: Engine) -> None:
    """In a batched propose, each request verifies its neighbour's drafts (cut or padded to its own span):
    lossless (verify rejects them), invisible at bs=1, and acceptance collapses under concurrency."""
    lane = engine.proposer
    propose = lane.propose

    def rotated(items):
        drafts = propose(items)
        if len(drafts) < 2:
            return drafts
        out = []
        for (_, _, _, span), d in zip(items, drafts[1:] + drafts[:1]):
            out.append((list(d) + [0] * span)[: span - 1])
        return out

    lane.propose = rotated


def break_drafter_head_is_the_embedding(engine: Engine) -> None:
    """The drafter projects with the target's input embedding instead of its lm_head (the same tensor on a
    tied target, so only an untied pair can tell)."""
    engine.drafter.lm_head = engine.drafter.embed_tokens


def break_target_head_is_the_embedding(engine: Engine) -> None:
    """The target projects with its input embedding instead of lm_head (invisible on a tied target)."""
    engine.target.lm_head = engine.target.embed_tokens


def edit_tensors(ckpt, fn) -> None:
    """Rewrite a checkpoint's model.safetensors after fn(tensors dict) changed it (corrupt-checkpoint tests)."""
    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))
