"""Turns a plan into batch tensors, runs the eager forward(s), and reads back argmax / top-k / features."""
from __future__ import annotations

import time

import torch

from refengine.attention.base import AttnBatch
from refengine.scheduler import DecodePlan, PrefillPlan, StepResult, VerifyPlan


LOGIT_CHUNK_ROWS = 1024  # logits rows materialised at once: bounds the [rows, vocab] transient (the planner
                         # profiles exactly this chunk)


def read_logits(target, hidden: torch.Tensor, k: int) -> tuple[list[int], list | None, list | None]:
    """Normed hidden [R, H] -> argmax per row, and the top-k ids / logprobs when k > 0, LOGIT_CHUNK_ROWS rows
    at a time. The argmax is taken in the model dtype (the fp32 cast is monotone, so it is exact)."""
    argmax, top_ids, top_lp = [], [] if k else None, [] if k else None
    for lo in range(0, hidden.shape[0], LOGIT_CHUNK_ROWS):
        logits = target.logits(hidden[lo:lo + LOGIT_CHUNK_ROWS], fp32=False)  # [r, V]
        argmax += logits.argmax(-1).tolist()
        if k:
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            top_ids += top.indices.tolist()
            top_lp += top.values.tolist()
    return argmax, top_ids, top_lp


class ModelRunner:
    def __init__(self, target, pool, attention, lane=None):
        self.target, self.pool, self.attention, self.lane = target, pool, attention, lane
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "draft_s": 0.0, "verify_s": 0.0}

    def _batch(self, spans: list[tuple[int, int, int]]) -> AttnBatch:
        """spans: (req_id, start, q_len): rows at positions [start, start + q_len), KV already reserved."""
        dev = self.target.device
        slots = torch.cat([self.pool.slots(r, s, s + n) for r, s, n in spans]).to(dev)
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in spans]).to(dev)
        return AttnBatch(q_lens=[n for _, _, n in spans], kv_lens=[s + n for _, s, n in spans],
                         block_tables=[self.pool.allocator.table(r) for r, _, _ in spans],
                         slots=slots, positions=positions)

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def _run(self, tokens: list[list[int]], spans, capture: tuple[int, ...], score_rows: list[range],
             topk_k: list[int]):
        """One target forward. score_rows[i]: which of request i's rows need logits (relative indices)."""
        batch = self._batch(spans)
        ids = torch.tensor([t for ts in tokens for t in ts], device=self.target.device)
        hidden, feats = self.target.forward(ids, batch, self.pool, self.attention, capture)
        offsets = [0]
        for n in batch.q_lens:
            offsets.append(offsets[-1] + n)
        rows = torch.tensor([offsets[i] + j for i, rr in enumerate(score_rows) for j in rr], device=ids.device)
        argmax, top_ids, top_lp = read_logits(self.target, hidden[rows], max(topk_k, default=0))
        out_argmax, out_topk, out_feats, r = [], [], [], 0
        for i, rr in enumerate(score_rows):
            n = len(rr)
            out_argmax.append(argmax[r:r + n])
            k = topk_k[i]
            out_topk.append([(top_ids[j][:k], top_lp[j][:k]) for j in range(r, r + n)] if k else [])
            out_feats.append(feats[offsets[i]:offsets[i + 1]] if feats is not None else None)
            r += n
        return out_argmax, out_topk, out_feats

    def execute(self, plan) -> StepResult:
        t0 = time.perf_counter()
        if isinstance(plan, PrefillPlan):
            reqs = plan.requests
            spans = [(r.request_id, 0, len(r.prompt_ids)) for r in reqs]
            score = [range(len(r.prompt_ids)) if r.params.prompt_logprobs else range(len(r.prompt_ids) - 1,
                                                                                       len(r.prompt_ids))
                     for r in reqs]
            capture = self.lane.capture_layers if self.lane is not None and any(plan.capture) else ()
            a, t, f = self._run([r.prompt_ids for r in reqs], spans, capture, score,
                                [r.params.logprobs for r in reqs])
            self._sync()
            self.timings["prefill_s"] += time.perf_counter() - t0
            return StepResult(a, t, f, [])
        if isinstance(plan, DecodePlan):
            reqs = plan.requests
            spans = [(r.request_id, r.committed_len, 1) for r in reqs]
            a, t, f = self._run([[r.output_ids[-1]] for r in reqs], spans, (), [range(1)] * len(reqs),
                                [r.params.logprobs for r in reqs])
            self._sync()
            self.timings["decode_s"] += time.perf_counter() - t0
            return StepResult(a, t, f, [])
        assert isinstance(plan, VerifyPlan)
        view = self.pool.speculative_view(plan.reservation)
        drafts = self.lane.propose([(r.request_id, r.output_ids[-1], start, span)
                                    for r, (_, start, span) in zip(plan.requests, view)])
        self._sync()
        t1 = time.perf_counter()
        tokens = [[r.output_ids[-1]] + d for r, d in zip(plan.requests, drafts)]
        a, t, f = self._run(tokens, view, self.lane.capture_layers, [range(s) for _, _, s in view],
                            [0] * len(view))
        self._sync()
        t2 = time.perf_counter()
        self.timings["draft_s"] += t1 - t0
        self.timings["verify_s"] += t2 - t1
        n = len(plan.requests)
        for r in plan.requests:  # attribute the step's time evenly to the requests that shared it
            r.spec.draft_s += (t1 - t0) / n
            r.spec.verify_s += (t2 - t1) / n
        return StepResult(a, t, f, drafts)
