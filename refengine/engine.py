"""Engine: add_request / step / generate / score. One step = scheduler.schedule() -> runner.execute() -> commit()."""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refengine.attention import make_backend
from refengine.config import (
    DFlashConfig,
    EngineConfig,
    ModelConfig,
    max_context_tokens,
    read_config_json,
    read_stop_ids,
)
from refengine.errors import InvalidRequestError, StepError, TensorParallelError, UnsupportedConfigError
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory.planner import KvBudgetPlan
from refengine.memory.reservation import target_kv_bytes_per_block
from refengine.models.dflash import DFlashDrafter
from refengine.models.qwen3 import Qwen3Model
from refengine.parallel import TensorParallelGroup, shard_target
from refengine.plan import Plan, PrefillPlan, validate_result
from refengine.request import FinishReason, Request, SamplingParams, SpecStats
from refengine.runner.capture import Capturer
from refengine.runner.catch_up_graphs import CatchUpGraphs
from refengine.runner.graph_setup import build_draft_graph, build_target_graphs
from refengine.runner.graphs import GraphRunner
from refengine.runner.logits import TopK
from refengine.runner.model_runner import ModelRunner
from refengine.scheduler import Scheduler
from refengine.spec_decode.acceptance_profile import AcceptanceOverride
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.lane import DFlashLane
from refengine.spec_decode.proposer import Proposer
from refengine.validation import validate_token_ids

log = logging.getLogger("refengine")
CPU_KV_BYTES = 256 * 1024 * 1024  # default KV pool on the CPU


@dataclass(frozen=True)
class ScoredSequence:
    """Teacher-forced scores of prompt + continuation: topk[p] is the top-k after token_ids[:p+1]."""

    token_ids: list[int]
    topk: list[TopK]


def _check_shared_target(target: Qwen3Model, config: EngineConfig, dtype: torch.dtype) -> None:
    """A target handed to Engine must be what config would load: same geometry, device and dtype, unsharded."""
    want = ModelConfig.from_hf(read_config_json(config.target_path))
    got_device, got_dtype = target.embed_tokens.device, target.embed_tokens.dtype
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device: cuda:0 by default
        device = torch.device("cuda", torch.cuda.current_device())
    if config.tensor_parallel_size > 1 or target.tp_size > 1:
        raise UnsupportedConfigError("a shared target cannot be tensor-parallel (each engine shards its own)")
    if target.cfg != want or got_dtype != dtype or got_device != device:
        raise UnsupportedConfigError(
            f"the shared target ({got_device}, {got_dtype}, {target.cfg}) is not the model config loads "
            f"({config.device}, {dtype}, {want})"
        )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        proposer: Proposer | None = None,
        acceptance_override: AcceptanceOverride | None = None,
        target: Qwen3Model | None = None,
    ):
        """`proposer` replaces the DFlash lane (the test proposers use it); by default a drafter given in
        `config.draft_path` is loaded and speculates when `config.speculative`. `acceptance_override` is
        benchmark-only: `refengine bench --acceptance-profile` passes it (outputs stop being greedy-exact).
        `target`: another engine's loaded target (config.target_path's model, on config's device and dtype) to
        read instead of loading a copy: engines stepping one at a time may share it, as the paired bench's do
        (its weights are only read; one copy means one placement in memory, refengine/bench/paired.py)."""
        if acceptance_override is not None and not isinstance(acceptance_override, AcceptanceOverride):
            raise UnsupportedConfigError("acceptance_override must be an AcceptanceOverride (refengine bench)")
        self.config = config
        self.tp: TensorParallelGroup | None = None  # before anything past the argument checks can fail (close())
        dtype = getattr(torch, config.torch_dtype_name)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedConfigError(f"device={config.device!r} but torch sees no CUDA device")
        if target is None:
            target = Qwen3Model.load(
                config.target_path, dtype=dtype, device=config.device, synthetic=config.synthetic_weights
            )
        else:
            _check_shared_target(target, config, dtype)
        self.target = target
        if config.tensor_parallel_size > 1:
            # rank 0's shard; from here on target.cfg is the per-rank geometry (heads, KV heads, MLP width), so
            # the KV pool, its planner (per-rank KV bytes) and the attention backend are this rank's
            self.target = shard_target(self.target, 0, config.tensor_parallel_size)
        tcfg = self.target.cfg
        draft_cfg = None
        if config.draft_path:
            draft_cfg = DFlashConfig.from_hf(read_config_json(config.draft_path))
            draft_cfg.check_fits(tcfg)
        spec_cfg = draft_cfg if config.speculative else None
        self.max_context = max_context_tokens(tcfg, spec_cfg, config.max_model_len)
        self.kv_plan: KvBudgetPlan | None = None
        num_blocks = config.num_blocks or self._default_num_blocks(dtype, spec_cfg)
        self.drafter = (
            DFlashDrafter.load(config.draft_path, self.target, synthetic=config.synthetic_weights)
            if config.draft_path
            else None
        )
        self.proposer: Proposer | None = proposer
        if proposer is None and self.drafter is not None and config.speculative:
            self.proposer = DFlashLane.create(
                self.drafter,
                context_blocks=num_blocks,
                max_requests=config.max_num_seqs,
                page_size=config.page_size,
                backend=config.backend_name,
            )
        span = self.proposer.block_size if self.proposer is not None else 1
        self.pool = KvPool(
            tcfg.num_layers,
            num_blocks,
            config.page_size,
            tcfg.num_kv_heads,
            tcfg.head_dim,
            dtype,
            self.target.device,
            dummy_blocks=blocks_for(span, config.page_size),
        )
        if config.tensor_parallel_size > 1:
            # after planning (the CUDA profile runs rank 0's shard alone, without collectives): start the
            # workers, each with a pool of the same blocks, and route the row-parallel sums through the group
            self.tp = TensorParallelGroup(config, num_blocks, len(self.pool.dummy_blocks))
            self.target.all_reduce = self.tp.all_reduce
        attention = make_backend(config.backend_name, self.pool, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim)
        self.store: FeatureStore | None = None  # tap features by target KV slot, read by the proposer
        if self.proposer is not None:
            width = len(self.proposer.capture_layers) * tcfg.hidden_size
            self.store = FeatureStore(self.pool, width, dtype, self.target.device)
            self.proposer.bind_feature_store(self.store)
        self.scheduler = Scheduler(
            self.pool,
            self.proposer,
            vocab_size=tcfg.vocab_size,
            eos_ids=read_stop_ids(config.target_path, tcfg),
            max_context=self.max_context,
            max_num_seqs=config.max_num_seqs,
            max_prefill_tokens=config.max_prefill_tokens,
            speculation=config.speculation,
            acceptance_override=acceptance_override,
        )
        self.runner = ModelRunner(
            self.target, self.pool, attention, self.proposer, self._graphs(), tp=self.tp, store=self.store
        )
        self.scheduler.bind_timings(
            self.runner.timings,
            self.runner.verify_rows,
            self.runner.graph_captures,
            buckets=(self.runner.batch_bucket, self.runner.draft_bucket),
            draft_caps=self.runner.draft_score_cap,
        )
        if self.scheduler.policy is not None:  # adaptive: its cost samples and next choice, while graphs run
            self.runner.while_waiting = self.scheduler.while_waiting
        self.scheduler.shadow_probes = config.shadow_probes and self.scheduler.policy is not None
        self._ids = itertools.count()
        self.finished: list[Request] = []
        self.last_plan: Plan | None = None  # the plan the last step ran (None: it had no work)

    def _default_num_blocks(self, dtype: torch.dtype, draft_cfg: DFlashConfig | None) -> int:
        """Planned from device memory on CUDA (before the drafter loads: the reservation bills it), else
        enough for max_num_seqs full-length requests within CPU_KV_BYTES."""
        c = self.target.cfg
        if self.target.device.type == "cuda":
            from refengine.memory.profile import cap_torch_allocator, plan_device_pool

            self.kv_plan = plan_device_pool(self.target, self.config, draft_cfg, self.max_context)
            cap_torch_allocator(self.kv_plan, self.target.device)
            return self.kv_plan.num_blocks
        bytes_per_block = target_kv_bytes_per_block(c, self.config.page_size, dtype.itemsize)
        wanted = self.config.max_num_seqs * blocks_for(self.max_context, self.config.page_size)
        return max(1, min(wanted, CPU_KV_BYTES // bytes_per_block))

    def _graphs(self) -> dict[str, GraphRunner]:
        """The decode / verify graph runners (and the lane's draft graph) unless graph_mode is 'eager'."""
        if self.config.graph_mode_name == "eager":
            return {}
        capturer = Capturer(self.target.device)
        # with shadow probes, the drafter's graphs in a memory pool of their own: a shadow probe's draft replays
        # beside the decode graph (runner/shadow_drafts.py), so their temporaries must not share addresses
        lane_capturer = Capturer(self.target.device) if self.config.shadow_probes else capturer
        taps = self.proposer.capture_layers if self.proposer is not None else ()
        span = self.proposer.block_size if self.proposer is not None else None
        store = self.store.rows if self.store is not None else None
        if isinstance(self.proposer, DFlashLane):
            self.proposer.graph = build_draft_graph(
                self.proposer.drafter, self.proposer.pool, self.config, lane_capturer, store
            )
            if self.store is not None:
                self.proposer.catch_up_graphs = CatchUpGraphs(
                    self.proposer.graph.stack, lane_capturer, self.store.pool.dummy_slot
                )
        adaptive = self.config.speculation == "adaptive"  # its retired requests decode without taps
        return build_target_graphs(
            self.target, self.pool, self.config, capturer, taps, span, store, plain_decode=adaptive
        )

    def capture_graphs(self) -> int:
        """Capture every CUDA graph shape now instead of on first use (what `refengine bench` and `serve` do at
        start-up, so no timed or served step pays a capture), and time each shape's replay to seed the adaptive
        policy's cost table; returns how many were captured. No-op in eager.

        On CUDA, start-up ends here: what is alive (weights, modules, graphs, imported libraries) is moved out
        of the garbage collector's generations (gc.freeze, after a collection), so its full passes scan only
        what serving allocates. Without it, Qwen3-4B adaptive decode at c32 on the H200 spent 0.26 ms a step
        in the collector (21 passes in 384 steps; plain decode: 1), 5% of the step. A frozen engine's KV pools
        are still freed when its last reference goes: reference counting alone frees them (tests/unit/
        test_graphs.py checks with the collector off)."""
        captured = self.runner.capture_graphs()
        policy = self.scheduler.policy
        if policy is not None and self.runner.graphs:  # the adaptive policy starts from timed replays
            for kind, key, seconds in self.runner.shape_costs():
                policy.cost.seed(kind, key, seconds)
        if self.target.device.type == "cuda":
            gc.collect()
            gc.freeze()
        return captured

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at tp 1). Idempotent; the engine cannot step after."""
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def max_context_tokens(self) -> int:
        return self.max_context

    # ---- the public API ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request. One that can never be served finishes at once with FinishReason.REJECTED and a
        message (see Request.reject_reason); the engine keeps serving everyone else."""
        req = Request(next(self._ids), prompt_ids, params or SamplingParams())  # type: ignore[arg-type]
        self.scheduler.add(req)
        if req.finished:
            self.finished.append(req)
        return req

    def step(self) -> list[Request]:
        """Run one plan as a transaction; return the requests that finished in it.

        Policy on failure (refengine/scheduler.py): an exception from executing the plan (any forward, the
        proposer's draft, a result that does not match the plan) rolls the plan back completely, then its
        requests are retried; one in a second failed step finishes with FinishReason.ERROR and the exception
        in its message (its KV and drafter context freed). A failure inside commit is a refengine bug: the
        plan's unfinished requests finish with ERROR. Nothing is re-raised (except KeyboardInterrupt and
        other non-Exception exits, and a TensorParallelError: a dead rank or a closed group, after the
        rollback), every other request goes on producing exactly its bs=1 output, and the engine keeps
        serving. A failure in the adaptive policy's choice (in the schedule) decodes that step plainly, logged
        and counted (Scheduler._choose)."""
        sched = self.scheduler
        host_timing = sched.costs if sched.costs is not None and sched.costs.policy.cost.price_host else None
        if host_timing is not None:
            host_timing.step_started()  # the host's share of the step, priced by the policy (CostModel.price_host)
        plan = self.last_plan = sched.schedule()
        if plan is not None:
            try:
                result = self.runner.execute(plan)
                if sched.policy is not None:
                    sched.while_waiting()  # (a graphed step did it while its graph ran: then a no-op)
                validate_result(
                    plan,
                    result,
                    self.target.cfg.vocab_size,
                    self.proposer.staged_requests() if self.proposer is not None else set(),
                )
            except BaseException as e:
                self._log_failure(plan, e)
                try:
                    sched.rollback(plan, e, count=isinstance(e, Exception))
                except Exception as e2:
                    sched.abandon(plan, e2)
                if not isinstance(e, Exception) or isinstance(e, TensorParallelError):
                    raise  # a dead rank or a failed collective: the engine cannot go on (see TensorParallelError)
            else:
                try:
                    sched.commit(plan, result)
                except Exception as e:
                    self._log_failure(plan, e)
                    sched.abandon(plan, e)
                else:
                    if host_timing is not None and not isinstance(plan, PrefillPlan):
                        host_timing.step_ended(plan)
        done = sched.take_done()
        self.finished.extend(done)
        return done

    @staticmethod
    def _log_failure(plan: Plan, e: BaseException) -> None:
        ids = [r.request_id for r in plan.requests]
        log.warning("%s of requests %s failed: %s: %s", type(plan).__name__, ids, type(e).__name__, e)
        log.debug("the failed step's traceback", exc_info=e)

    def abort(self, request_id: int, message: str = "aborted by the caller") -> bool:
        """Finish a waiting or running request now with FinishReason.ABORTED and `message`; its KV blocks,
        lifetime reservation and drafter context are freed at once. False if the id is unknown or the request
        already finished. Call it between steps (the engine is single-threaded)."""
        req = self.scheduler.abort(request_id, message)
        if req is None:
            return False
        self.finished.append(req)
        return True

    def get_request(self, request_id: int) -> Request | None:
        """The live (waiting or running) request with this id; None once it finished or if it never existed."""
        return self.scheduler.get(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Request]:
        """Submit all prompts together and run to completion (continuous batching). Returns them in order."""
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return reqs

    def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int = 8) -> list[ScoredSequence]:
        """Teacher forcing: for each (prompt, continuation), the top-k after every prefix of prompt +
        continuation (one row per position, the last predicting past the sequence). The prompt runs as a
        prefill, the continuation as decode steps: before each step the request's current token (whose KV is
        not written yet) is replaced by the next continuation token. All sequences run together."""
        runs = []
        for prompt, continuation in sequences:
            cont = validate_token_ids(continuation, self.target.cfg.vocab_size, "continuation_ids")
            params = SamplingParams(max_tokens=len(cont) + 1, logprobs=k, prompt_logprobs=True, ignore_eos=True)
            runs.append((self.add_request(prompt, params), cont))
        for req, _ in runs:
            if req.reject_reason is not None:
                raise InvalidRequestError(f"scoring request rejected ({req.reject_reason.value}): {req.message}")
        while any(not req.finished for req, _ in runs):
            self.step()
            failed = next((r for r, _ in runs if r.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED)), None)
            if failed is not None:
                for req, _ in runs:
                    self.abort(req.request_id, f"scoring aborted: request {failed.request_id} failed")
                reason = failed.finish_reason.value if failed.finish_reason else "failed"
                raise StepError(f"scoring request {failed.request_id} {reason}: {failed.message}")
            for req, cont in runs:
                n = len(req.output_ids)
                if not req.finished and 0 < n <= len(cont):
                    req.output_ids[-1] = cont[n - 1]  # force the token the next decode step feeds
        return [ScoredSequence(list(req.prompt_ids) + cont, list(req.topk)) for req, cont in runs]

    def spec_stats(self, requests: list[Request] | None = None) -> SpecStats:
        """The merged SpecStats of `requests` (default: every finished request)."""
        if requests is not None:  # running requests' stats lag by an open plain stretch until it closes
            self.scheduler.close_stretch()
        total = SpecStats()
        for r in requests if requests is not None else self.finished:
            total.merge(r.spec)
        return total

    def check_integrity(self) -> None:
        """Scheduler, KV pool and proposer agree (IntegrityError naming the disagreement otherwise)."""
        self.scheduler.check_integrity()
