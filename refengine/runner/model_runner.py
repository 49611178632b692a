"""Turns a plan into batch tensors, runs the eager forward(s), and reads back argmax / top-k. Tap-layer
features go into the feature store at the rows' KV slots (inside the graphs, or after an eager forward); the
proposer is told which rows of speculating requests it may use once the scheduler commits them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from refengine.attention.base import AttentionBackend, AttnBatch
from refengine.kv.pool import KvPool
from refengine.models.qwen3 import Qwen3Model
from refengine.models.segmented import SegmentedStack, StepState
from refengine.parallel.group import TensorParallelGroup
from refengine.plan import DecodePlan, Plan, PrefillPlan, StepResult
from refengine.request import Request
from refengine.runner.catch_up_graphs import CatchUpGraphs
from refengine.runner.critical_path import CriticalPathClock
from refengine.runner.draft_graphs import DraftGraphs
from refengine.runner.graphs import GraphRunner, StepRow
from refengine.runner.logits import TopK, read_logits
from refengine.runner.sampled_picks import draw_rows
from refengine.runner.verify_step import VerifyStep
from refengine.span_policy.base import ShapeCost, StepShapes
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.proposer import Proposer

Span = tuple[int, int, int]  # (req_id, start, q_len): rows at positions [start, start + q_len), KV reserved


class ModelRunner(VerifyStep):
    def __init__(
        self,
        target: Qwen3Model,
        pool: KvPool,
        attention: AttentionBackend,
        proposer: Proposer | None = None,
        graphs: dict[str, GraphRunner] | None = None,
        tp: TensorParallelGroup | None = None,
        store: FeatureStore | None = None,
        draft: DraftGraphs | None = None,
        sampled_drafts: bool = True,
    ):
        self.tp = tp  # tensor parallel: every target forward's inputs go to the other ranks first
        self.target, self.pool, self.attention, self.proposer = target, pool, attention, proposer
        self.graphs = graphs or {}  # "decode" / "verify" runners when a graph mode is on
        self.draft_graphs = draft  # the lane's draft and catch-up graphs (its executor), when a graph mode is on
        self.store = store  # tap features by KV slot, with a proposer (spec_decode/feature_store.py)
        # a sampling request's drafts: drawn from the drafter's processed distribution, or its argmax
        self.sampled_drafts = sampled_drafts
        # with graphs, steps outside them (prefills, steps no graph fits) run the graphs' segmented stack
        # eagerly: merged weights and fused kernels (a 128-token Qwen3-4B prefill: 10-14 ms on the H200)
        decode = self.graphs.get("decode")
        self.stack: SegmentedStack | None = decode.stack if decode is not None else None
        # wall time per step kind; sync_wait_s: time the host sat waiting for graphed steps' results (wall time
        # minus it is the host's own work: scheduling, packing inputs, planning attention, launching)
        # catch_up_s: the part of draft_s spent projecting more pending drafter context than the draft graph
        # takes (after a prompt, or steps at span 1: catch-up graph replays)
        # critical_s: host time from reading results back (a sync) to queueing the next graph replay, which the
        # device spends idle: the step's commit, the next schedule, its inputs and attention plan (graph modes)
        self.timings = {
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "draft_s": 0.0,
            "verify_s": 0.0,
            "sync_wait_s": 0.0,
            "catch_up_s": 0.0,
            "critical_s": 0.0,
        }
        self.clock = CriticalPathClock(self.timings)
        for runner in self._graph_runners():
            runner.on_launch = self.clock.launching

    def _graph_runners(self) -> list[GraphRunner | CatchUpGraphs]:
        """Every graph runner of the engine: the target's decode / verify, the drafter's and its catch-ups'."""
        draft = self.draft_graphs.runners() if self.draft_graphs is not None else []
        return [*self.graphs.values(), *draft]

    def graph_captures(self) -> int:
        """Graphs captured so far, the drafter's included (a step that captured one took longer than it costs)."""
        return sum(r.captures for r in self._graph_runners())

    def capture_graphs(self) -> int:
        """Capture every graph shape now (decode, verify, draft, catch-up); returns how many were new."""
        return sum(r.capture_all() for r in self._graph_runners())

    def step_shapes(self) -> StepShapes:
        """How steps are shaped (the span policy's cost keys): the graphs' batch buckets and row caps; a kind
        without graphs runs at the step's own size."""
        decode, verify = self.graphs.get("decode"), self.graphs.get("verify")
        draft = self.draft_graphs.graph if self.draft_graphs is not None else None

        def caps(runner: GraphRunner | None) -> tuple[int, ...]:
            if runner is None:
                return ()
            return tuple(runner.caps) if runner.capture_shape_rule else (runner.span,)

        return StepShapes(
            batch_buckets=tuple(decode.buckets) if decode is not None else (),
            draft_buckets=tuple(draft.buckets) if draft is not None else (),
            verify_caps=caps(verify),
            draft_caps=caps(draft),
        )

    def shape_costs(self) -> list[ShapeCost]:
        """Timed replays of every captured shape (decode, verify, draft): the span policy's start-up costs."""
        out: list[ShapeCost] = []
        runners = (("decode", self.graphs.get("decode")), ("verify", self.graphs.get("verify")))
        draft = self.draft_graphs.graph if self.draft_graphs is not None else None
        for kind, runner in (*runners, ("draft", draft)):
            if runner is not None:
                for (bucket, cap), s in runner.time_shapes().items():
                    out.append(ShapeCost(kind, bucket, cap, s))
        return out

    def _replay(
        self,
        kind: str,
        steps: list[StepRow],
        capture: bool,
        whole_step: bool = False,
        fill: Callable[[StepState], None] | None = None,
    ) -> tuple[list[list[int]], torch.Tensor] | None:
        """Run the step from the `kind` graph when there is one that fits; None means run it eagerly.
        Returns the argmax of every real row per request and the final normed rows [real rows, H] (the
        graph's buffer: read it before the next replay), and stages every row when `capture` (`whole_step`:
        a decode plan's, one row per request, staged in one call)."""
        runner = self.graphs.get(kind)
        if runner is None or not runner.fits(steps):
            return None
        # a graph with taps writes every row's tap features into the store at its slots
        g = runner.run(steps, fill=fill)
        lens = [len(s.tokens) for s in steps]
        total = sum(lens)
        if capture and self.proposer is not None:
            self._stage([(s.req_id, s.start, n) for s, n in zip(steps, lens)], whole_step)
        t = time.perf_counter()
        argmax = g.buffers.argmax[:total].tolist()  # the one host sync of the step
        self.timings["sync_wait_s"] += self.clock.synced() - t
        out, row = [], 0
        for n in lens:
            out.append(argmax[row : row + n])
            row += n
        return out, g.buffers.hidden[:total]

    def _stage(self, spans: list[Span], whole_step: bool, capture: list[bool] | None = None) -> None:
        """Tell the proposer which rows of this step have features in the store (held until the commit):
        `whole_step`, a decode plan's one row per request, in one call; else each request's rows (only those
        of `capture`, when given)."""
        assert self.proposer is not None
        if whole_step:
            rows = spans if capture is None else [sp for sp, c in zip(spans, capture) if c]
            self.proposer.stage_step([r for r, _, _ in rows], [start for _, start, _ in rows])
            return
        for i, (req_id, start, n) in enumerate(spans):
            if capture is None or capture[i]:
                self.proposer.stage_features(req_id, start, n)

    def _batch(self, spans: list[Span]) -> AttnBatch:
        dev = self.target.device
        slots = torch.cat([self.pool.slots(r, s, s + n) for r, s, n in spans]).to(dev)
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in spans]).to(dev)
        return AttnBatch(
            q_lens=[n for _, _, n in spans],
            kv_lens=[s + n for _, s, n in spans],
            block_tables=[self.pool.table(r) for r, _, _ in spans],
            slots=slots,
            positions=positions,
        )

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        self.clock.synced()

    def _forward_segmented(
        self, ids: torch.Tensor, batch: AttnBatch, taps: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """target.forward's contract (final normed hidden [T, H], tap features [T, F*H] or None) on the segmented
        stack, over buffers of this step's rows."""
        stack = self.stack
        assert stack is not None
        w = stack.embed
        st = StepState.allocate(
            stack.cfg,
            ids.shape[0],
            torch.empty(0, dtype=torch.long),
            len(stack.tap_layers) if taps else 0,
            w.dtype,
            w.device,
            zeroed=False,
        )
        st.ids, st.positions, st.slots = ids, batch.positions, batch.slots  # this step's own tensors, not copies
        self.attention.prepare(batch)

        def attend(layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(self.attention.attend(layer, q))

        stack.run_eager(st, attend)
        return st.hidden, st.taps

    @torch.inference_mode()
    def _run(
        self,
        tokens: list[list[int]],
        spans: list[Span],
        capture: list[bool],
        score_rows: list[range],
        topk_k: list[int],
        whole_step: bool = False,
    ) -> tuple[list[list[int]], list[list[TopK]], torch.Tensor]:
        """One target forward. score_rows[i]: which of request i's rows need logits (relative indices);
        capture[i]: stage request i's tap-layer features with the proposer (`whole_step`: a decode plan's
        rows, one per request, all captured, staged in one call). Returns the argmax and top-k of every
        scored row, and those rows' final normed hidden states [scored rows, H]."""
        batch = self._batch(spans)
        ids = torch.tensor([t for ts in tokens for t in ts], device=self.target.device)
        layers = self.proposer.capture_layers if self.proposer is not None and any(capture) else ()
        if self.tp is not None:
            self.tp.send_forward(ids, batch)
        if self.stack is not None:
            hidden, feats = self._forward_segmented(ids, batch, bool(layers))
        else:
            hidden, feats = self.target.forward(ids, batch, self.pool, self.attention, layers)
        offsets = [0]
        for n in batch.q_lens:
            offsets.append(offsets[-1] + n)
        if feats is not None and self.proposer is not None:
            if self.stack is None and self.store is not None:  # the segmented stack wrote them itself
                self.store.write(batch.slots, feats)
            self._stage(spans, whole_step, capture)
        rows = torch.tensor([offsets[i] + j for i, rr in enumerate(score_rows) for j in rr], device=ids.device)
        scored = hidden[rows]
        argmax, top_ids, top_lp = read_logits(self.target, scored, max(topk_k, default=0))
        out_argmax, out_topk, r = [], [], 0
        for i, rr in enumerate(score_rows):
            n, k = len(rr), topk_k[i]
            out_argmax.append(argmax[r : r + n])
            out_topk.append([(top_ids[j][:k], top_lp[j][:k]) for j in range(r, r + n)] if k else [])
            r += n
        return out_argmax, out_topk, scored

    @torch.inference_mode()  # graph buffers are inference tensors wherever they were first made
    def execute(self, plan: Plan) -> StepResult:
        """Run a plan. The result's `seconds` (and a verify's `draft_seconds`) are set when the step is a cost
        sample: it captured no graph (a capture takes far longer than the step)."""
        t0 = time.perf_counter()
        captures = self.graph_captures()
        if isinstance(plan, PrefillPlan):
            reqs = plan.requests
            # a prompt's cached prefix (plan.cached) is in the KV already: only the rest runs
            cached = [plan.cached_tokens(i) for i in range(len(reqs))]
            spans = [(r.request_id, c, len(r.prompt_ids) - c) for r, c in zip(reqs, cached)]
            score = [range(n) if r.params.prompt_logprobs else range(n - 1, n) for r, (_, _, n) in zip(reqs, spans)]
            a, t, hidden = self._run(
                [r.prompt_ids[c:] for r, c in zip(reqs, cached)],
                spans,
                plan.capture,
                score,
                [r.params.logprobs for r in reqs],
            )
            last = [sum(len(s) for s in score[: i + 1]) - 1 for i in range(len(reqs))]  # each one's last row
            self._draw(reqs, [len(r.prompt_ids) - 1 for r in reqs], a, hidden, last)
            self._sync()
            self.timings["prefill_s"] += time.perf_counter() - t0
            return StepResult(a, t)
        result = self._decode(plan) if isinstance(plan, DecodePlan) else self._verify(plan)
        if isinstance(plan, DecodePlan):
            result.seconds = time.perf_counter() - t0
            self.timings["decode_s"] += result.seconds
        if self.graph_captures() != captures:
            result.seconds = result.draft_seconds = None
        return result

    def _decode(self, plan: DecodePlan) -> StepResult:
        reqs = plan.requests
        graphed = (
            None
            if any(r.params.logprobs for r in reqs)
            else self._replay(
                "decode",
                [StepRow(r.request_id, r.committed_len, [r.output_ids[-1]], r.committed_len + 1) for r in reqs],
                capture=plan.capture,
                whole_step=plan.capture,
            )
        )
        starts = [r.committed_len for r in reqs]
        if graphed is not None:
            self._draw(reqs, starts, graphed[0], graphed[1], list(range(len(reqs))))
            return StepResult(graphed[0])
        spans = [(r.request_id, r.committed_len, 1) for r in reqs]
        a, t, hidden = self._run(
            [[r.output_ids[-1]] for r in reqs],
            spans,
            [plan.capture] * len(reqs),
            [range(1)] * len(reqs),
            [r.params.logprobs for r in reqs],
            whole_step=plan.capture,
        )
        self._draw(reqs, starts, a, hidden, list(range(len(reqs))))
        self._sync()
        return StepResult(a, t)

    def _draw(
        self, reqs: list[Request], starts: list[int], picks: list[list[int]], hidden: torch.Tensor, rows: list[int]
    ) -> None:
        """Replace the last pick of each sampling request with a token drawn from its stream: request i's
        current token is at starts[i], its row in `hidden` is rows[i]."""
        drawn = [i for i, r in enumerate(reqs) if r.params.sampled]
        if not drawn:
            return
        index = torch.tensor([rows[i] for i in drawn], device=hidden.device)
        tokens = draw_rows(self.target, [reqs[i] for i in drawn], [starts[i] for i in drawn], hidden[index])
        for i, tok in zip(drawn, tokens):
            picks[i][-1] = tok
