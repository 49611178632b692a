"""Engine: add_request / step / generate / score. One step = scheduler.schedule() -> runner.execute() -> commit()."""

from __future__ import annotations

import gc
import itertools
import logging
import secrets
import time
from collections.abc import Sequence

import torch

from refengine.attention import make_backend
from refengine.config import DFlashConfig, EngineConfig, max_context_tokens, read_config_json, read_stop_ids
from refengine.engine_parts import build_graphs, check_shared_target, default_num_blocks
from refengine.errors import InvalidRequestError, TensorParallelError, UnsupportedConfigError
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory.planner import KvBudgetPlan
from refengine.models.dflash import DFlashDrafter
from refengine.models.qwen3 import Qwen3Model
from refengine.parallel import TensorParallelGroup, shard_target
from refengine.plan import Plan, validate_result
from refengine.request import Request, SamplingParams, SpecStats
from refengine.runner.model_runner import ModelRunner
from refengine.scheduler import Scheduler
from refengine.scoring import ScoredSequence, score_sequences
from refengine.span_policy.base import SpanPolicy, build_span_policy
from refengine.spec_decode.acceptance_profile import AcceptanceOverride
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.lane import DFlashLane
from refengine.spec_decode.proposer import Proposer

log = logging.getLogger("refengine")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        proposer: Proposer | None = None,
        acceptance_override: AcceptanceOverride | None = None,
        target: Qwen3Model | None = None,
        span_policy: SpanPolicy | None = None,
    ):
        """`proposer` replaces the DFlash lane (the test proposers use it); by default a drafter given in
        `config.draft_path` is loaded and speculates when `config.speculative`. `span_policy` replaces the
        one `config.speculation` names (a SpanPolicy: refengine/span_policy/base.py). `acceptance_override` is
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
            check_shared_target(target, config, dtype)
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
        num_blocks = config.num_blocks
        if not num_blocks:
            num_blocks, self.kv_plan = default_num_blocks(self.target, config, dtype, spec_cfg, self.max_context)
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
            prefix_caching=config.enable_prefix_caching,
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
        self.span_policy: SpanPolicy | None = None
        if self.proposer is not None:
            self.span_policy = span_policy or build_span_policy(config.speculation, self.proposer.block_size)
        self.scheduler = Scheduler(
            self.pool,
            self.proposer,
            self.span_policy,
            vocab_size=tcfg.vocab_size,
            eos_ids=read_stop_ids(config.target_path, tcfg),
            max_context=self.max_context,
            max_num_seqs=config.max_num_seqs,
            max_prefill_tokens=config.max_prefill_tokens,
            acceptance_override=acceptance_override,
        )
        graphs, draft_graphs = build_graphs(config, self.target, self.pool, self.proposer, self.store)
        self.runner = ModelRunner(
            self.target,
            self.pool,
            attention,
            self.proposer,
            graphs,
            tp=self.tp,
            store=self.store,
            draft=draft_graphs,
            sampled_drafts=config.draft_sampling == "sampled",
        )
        if self.span_policy is not None:
            self.span_policy.start(self.runner.step_shapes())
        self._ids = itertools.count()
        self.finished: list[Request] = []
        self.last_plan: Plan | None = None  # the plan the last step ran (None: it had no work)

    def capture_graphs(self) -> int:
        """Capture every CUDA graph shape now instead of on first use (what `refengine bench` and `serve` do at
        start-up, so no timed or served step pays a capture), and time each shape's replay to seed the span
        policy's cost table; returns how many were captured. No-op in eager.

        On CUDA, start-up ends here: what is alive (weights, modules, graphs, imported libraries) is moved out
        of the garbage collector's generations (gc.freeze, after a collection), so its full passes scan only
        what serving allocates. Without it, Qwen3-4B decode at c32 on the H200 spent 0.26 ms a step
        in the collector (21 passes in 384 steps; plain decode: 1), 5% of the step. A frozen engine's KV pools
        are still freed when its last reference goes: reference counting alone frees them (tests/unit/
        test_graphs.py checks with the collector off)."""
        captured = self.runner.capture_graphs()
        if self.span_policy is not None and self.runner.graphs:  # the policy's costs start from timed replays
            self.span_policy.start(self.runner.step_shapes(), self.runner.shape_costs())
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
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(next(self._ids), prompt_ids, params, seed=seed)  # type: ignore[arg-type]
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
        serving. A failure in the span policy's choice (in the schedule) decodes that step plainly, logged
        and counted (Scheduler._choose)."""
        sched = self.scheduler
        t0 = time.perf_counter()
        plan = self.last_plan = sched.schedule()
        if plan is not None:
            try:
                t1 = time.perf_counter()
                result = self.runner.execute(plan)
                executed = time.perf_counter() - t1
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
                else:  # the step's host time outside the runner joins its cost sample
                    sched.report_step(time.perf_counter() - t0 - executed)
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
        """Teacher forcing: the top-k after every prefix of each prompt + continuation (refengine/scoring.py)."""
        return score_sequences(self, sequences, k)

    def spec_stats(self, requests: list[Request] | None = None) -> SpecStats:
        """The merged SpecStats of `requests` (default: every finished request)."""
        total = SpecStats()
        for r in requests if requests is not None else self.finished:
            total.merge(r.spec)
        return total

    def span_stats(self) -> dict:
        """The span policy's record, JSON-ready: `policy` ("fixed" or "adaptive"), `spans` (verify span chosen ->
        request-steps, as strings; 1 = a drafting request decoded plainly), `errors` (choices that raised: those
        steps decoded plainly) and `detail` (the policy's own statistics)."""
        sched, policy = self.scheduler, self.span_policy
        return {
            "policy": policy.name if policy is not None else "off",
            "spans": {str(k): v for k, v in sorted(sched.span_counts.items())},
            "errors": sched.policy_errors,
            "detail": policy.stats() if policy is not None else {},
        }

    def prefix_cache_stats(self) -> dict:
        """The prefix cache's record, JSON-ready (PrefixCache.report); {"enabled": False} without one."""
        cache = self.pool.prefix_cache
        return cache.report() if cache is not None else {"enabled": False}

    def check_integrity(self) -> None:
        """Scheduler, KV pool and proposer agree (IntegrityError naming the disagreement otherwise)."""
        self.scheduler.check_integrity()
