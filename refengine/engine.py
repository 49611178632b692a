"""Engine: add_request / step / generate. One step = scheduler.schedule() -> runner.execute() -> commit()."""
from __future__ import annotations

import itertools

import torch

from refengine.attention import make_backend
from refengine.config import DFlashConfig, EngineConfig, read_config_json
from refengine.errors import UnsupportedConfigError
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory import target_kv_bytes_per_block
from refengine.models.dflash import DFlashDrafter
from refengine.models.qwen3 import Qwen3Model
from refengine.request import Request, SamplingParams, SpecStats
from refengine.runner.model_runner import ModelRunner
from refengine.scheduler import Scheduler
from refengine.spec.lane import DFlashLane

CPU_KV_BYTES = 256 * 1024 * 1024   # default KV pool on the CPU


class Engine:
    def __init__(self, config: EngineConfig, *, proposer=None):
        self.config = config
        dtype = getattr(torch, config.torch_dtype_name)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedConfigError(f"device={config.device!r} but torch sees no CUDA device")
        self.target = Qwen3Model.load(config.target_path, dtype=dtype, device=config.device,
                                      synthetic=config.synthetic_weights)
        tcfg = self.target.cfg
        draft_cfg = None
        if config.draft_path:
            draft_cfg = DFlashConfig.from_hf(read_config_json(config.draft_path))
            draft_cfg.check_fits(tcfg)
        self.speculating = proposer is not None or (draft_cfg is not None and config.speculative)
        self.max_context = self._max_context(draft_cfg)
        # Plan the pool with the target resident and before the drafter loads: the reservation bills the
        # drafter's weights itself, so reading device memory after loading it would count them twice.
        self.kv_plan = None
        num_blocks = config.num_blocks or self._default_num_blocks(dtype, draft_cfg)
        self.drafter = (DFlashDrafter.load(config.draft_path, self.target, synthetic=config.synthetic_weights)
                        if draft_cfg is not None else None)
        self.lane = proposer if proposer is not None else (
            DFlashLane(self.drafter) if self.drafter is not None and config.speculative else None)
        self.pool = KvPool(tcfg.num_layers, num_blocks, config.page_size, tcfg.num_kv_heads, tcfg.head_dim,
                           dtype, self.target.device)
        attention = make_backend(config.backend_name, self.pool, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim)
        self.scheduler = Scheduler(self.pool, self.lane, vocab_size=tcfg.vocab_size, eos_ids=tcfg.eos_token_ids,
                                   max_context=self.max_context, max_num_seqs=config.max_num_seqs,
                                   max_prefill_tokens=config.max_prefill_tokens)
        self.runner = ModelRunner(self.target, self.pool, attention, self.lane)
        self._ids = itertools.count()
        self.finished: list[Request] = []

    def _max_context(self, draft_cfg: DFlashConfig | None) -> int:
        """The target's window; with DFlash on, the drafter's in-fill block writes B positions past the
        committed length, so its window minus B bounds the context too. max_model_len caps both."""
        limit = self.target.cfg.max_position_embeddings
        if self.speculating and draft_cfg is not None:
            limit = min(limit, draft_cfg.model.max_position_embeddings - draft_cfg.block_size)
        return min(limit, self.config.max_model_len or limit)

    def max_context_tokens(self) -> int:
        return self.max_context

    def _default_num_blocks(self, dtype: torch.dtype, draft_cfg: DFlashConfig | None) -> int:
        c = self.target.cfg
        if self.target.device.type == "cuda":
            from refengine.runner.planning import plan_pool
            self.kv_plan = plan_pool(self, draft_cfg if self.speculating else None)
            return self.kv_plan.num_blocks
        bytes_per_block = target_kv_bytes_per_block(c, self.config.page_size, dtype.itemsize)
        wanted = self.config.max_num_seqs * blocks_for(self.max_context, self.config.page_size)
        return max(1, min(wanted, CPU_KV_BYTES // bytes_per_block))

    # ---- the public API ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    forced_output_ids: list[int] | None = None) -> Request:
        """Queue a request. One that can never be served finishes at once with FinishReason.REJECTED and a
        message (see Request.reject_reason); the engine keeps serving everyone else."""
        req = Request(next(self._ids), list(prompt_ids), params or SamplingParams(),
                      forced_output_ids=list(forced_output_ids) if forced_output_ids is not None else None)
        self.scheduler.add(req)
        if req.finished:
            self.finished.append(req)
        return req

    def step(self) -> list[Request]:
        """Run one plan; return the requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        self.scheduler.commit(plan, self.runner.execute(plan))
        done = [r for r in plan.requests if r.finished]
        self.finished.extend(done)
        return done

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Request]:
        """Submit all prompts together and run to completion (continuous batching). Returns them in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(r.params.max_tokens for r in reqs), unit="tok", leave=False)
        while self.has_work():
            before = sum(len(r.output_ids) for r in reqs)
            self.step()
            if bar is not None:
                bar.update(sum(len(r.output_ids) for r in reqs) - before)
        if bar is not None:
            bar.close()
        return reqs

    def spec_stats(self, requests: list[Request] | None = None) -> SpecStats:
        total = SpecStats()
        for r in requests if requests is not None else self.finished:
            total.merge(r.spec)
        return total

    def check_integrity(self) -> None:
        self.pool.check_integrity()
