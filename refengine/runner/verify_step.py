"""A verify step (a mixin of ModelRunner, refengine/runner/model_runner.py): the drafts of the requests that
draft (span > 1) are launched on the device and handed to the verify graph there (runner/draft_handoff.py),
or proposed on the host and verified eagerly when no graph fits; the step's time is split into draft and
verify (VerifyClock) for the span policy's cost table and each request's stats."""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.kv.pool import KvPool
from refengine.models.qwen3 import Qwen3Model
from refengine.plan import Plan, StepResult, VerifyPlan
from refengine.runner.draft_handoff import VerifyClock, draft_fill, launch_drafts, placeholders
from refengine.runner.graphs import StepRow
from refengine.runner.logits import TopK
from refengine.runner.sampled_picks import sample_drafts, verify_picks
from refengine.spec_decode.proposer import DraftItem, Proposer


class VerifyStep:
    # what ModelRunner provides
    target: Qwen3Model
    pool: KvPool
    proposer: Proposer | None
    timings: dict[str, float]

    # ModelRunner's methods (their signatures there)
    _replay: Callable[..., tuple[list[list[int]], torch.Tensor] | None]
    _run: Callable[..., tuple[list[list[int]], list[list[TopK]], torch.Tensor]]
    sampled_drafts: bool
    _sync: Callable[[], None]

    def _verify(self, plan: Plan) -> StepResult:
        assert isinstance(plan, VerifyPlan) and self.proposer is not None
        clock = VerifyClock(self.target.device)
        view = self.pool.speculative_view(plan.reservation)
        items = [
            DraftItem(r.request_id, r.output_ids[-1], start, span) for r, (_, start, span) in zip(plan.requests, view)
        ]
        drafting = [i for i, it in enumerate(items) if it.span > 1]  # span 1: a plain row, no draft
        drafts: list[list[int]] = [[] for _ in items]
        sampled = self._sampled_drafts(plan, items, drafting, drafts) if drafting else None
        launched = launch_drafts(self.proposer, [items[i] for i in drafting]) if drafting and not sampled else None
        if drafting and launched is None and sampled is None:
            for i, d in zip(drafting, self.proposer.propose([items[i] for i in drafting])):
                drafts[i] = d
            self._sync()
        clock.drafted()
        if launched is not None:  # the drafts are still on the device: placeholders the verify graph swaps
            for j, i in enumerate(drafting):
                drafts[i] = placeholders(launched, j)
        tokens = [[r.output_ids[-1]] + d for r, d in zip(plan.requests, drafts)]
        kind = "verify" if any(span > 1 for _, _, span in view) else "decode"  # all span 1: every budget at its end
        graphed = self._replay(
            kind,
            [StepRow(rid, start, toks, start + span) for (rid, start, span), toks in zip(view, tokens)],
            capture=True,
            fill=draft_fill(launched) if launched is not None else None,
        )
        if launched is not None:  # the drafts, read back after the verify's own results (no second wait)
            for i, d in zip(drafting, launched.read()):
                drafts[i] = d
        if graphed is not None:
            a, hidden = graphed
        else:  # no verify graph fits: the eager forward, on the real drafts
            tokens = [[r.output_ids[-1]] + d for r, d in zip(plan.requests, drafts)]
            a, _, hidden = self._run(tokens, view, [True] * len(view), [range(s) for _, _, s in view], [0] * len(view))
        self._sample_picks(plan, view, a, hidden, drafts, sampled)
        if graphed is None:
            self._sync()
        self.timings["sync_wait_s"] += getattr(self.proposer, "take_sync_wait", lambda: 0.0)()
        catch_up_s = getattr(self.proposer, "take_catch_up", lambda: 0.0)()
        self.timings["catch_up_s"] += catch_up_s
        draft_s, verify_s = clock.split()
        self.timings["draft_s"] += draft_s
        self.timings["verify_s"] += verify_s
        n = len(plan.requests)
        for r in plan.requests:  # attribute the step's time evenly to the requests that shared it
            r.spec.draft_s += draft_s / n
            r.spec.verify_s += verify_s / n
        # the policy's sample leaves the catch-up out: context carried past a prompt or span-1 steps is
        # projected once whatever the spans, so it is no cost of this step's choice
        return StepResult(
            a, drafts=drafts, seconds=draft_s + verify_s - catch_up_s, draft_seconds=max(draft_s - catch_up_s, 0.0)
        )

    def _sampled_drafts(
        self, plan: VerifyPlan, items: list[DraftItem], drafting: list[int], drafts: list[list[int]]
    ) -> tuple[list[int], torch.Tensor] | None:
        """When a drafting request samples (with sampled drafts on), one draft forward for every drafting
        request (the draft graph's, its logits read from its final rows, or eager: the proposer's
        `draft_distribution_logits`): the greedy ones take its argmax, the sampling ones draw from its
        processed distribution.
        Fills `drafts`; returns (the indices of the requests that drew, their q [n, B-1, V]), or None when no
        request draws its drafts (then the drafts come from propose / the draft graph, as at temperature 0)."""
        assert self.proposer is not None
        logits_of = getattr(self.proposer, "draft_distribution_logits", None)
        sampled = [j for j, i in enumerate(drafting) if plan.requests[i].params.sampled]
        if not (self.sampled_drafts and sampled and logits_of is not None) or "propose" in vars(self.proposer):
            return None  # a replaced propose (tests' logs and faults) must see every draft: greedy drafts then
        logits = logits_of([items[i] for i in drafting])  # [n, B-1, V] fp32
        for j, i in enumerate(drafting):
            if not plan.requests[i].params.sampled:
                drafts[i] = logits[j, : items[i].span - 1].argmax(-1).tolist()
        chosen = [drafting[j] for j in sampled]
        drawn, q = sample_drafts(
            logits[torch.tensor(sampled, device=logits.device)],
            [plan.requests[i] for i in chosen],
            [items[i].start for i in chosen],
            [items[i].span for i in chosen],
        )
        for i, d in zip(chosen, drawn):
            drafts[i] = d
        self._sync()
        return chosen, q

    def _sample_picks(
        self,
        plan: VerifyPlan,
        view: list[tuple[int, int, int]],
        picks: list[list[int]],
        hidden: torch.Tensor,
        drafts: list[list[int]],
        sampled: tuple[list[int], torch.Tensor] | None,
    ) -> None:
        """Replace each sampling request's picks with speculative sampling's (hidden [all rows, H], request
        order; `sampled`: _sampled_drafts' result); greedy requests keep their argmax."""
        drawn = [i for i, r in enumerate(plan.requests) if r.params.sampled]
        if not drawn:
            return
        q = None
        if sampled is not None:  # q of every drawing request; one at span 1 (no drafts) gets zero rows
            chosen, q = sampled
            if chosen != drawn:
                full = q.new_zeros(len(drawn), *q.shape[1:])
                full[torch.tensor([drawn.index(i) for i in chosen], device=q.device)] = q
                q = full
        offsets = [0]
        for _, _, span in view:
            offsets.append(offsets[-1] + span)
        new = verify_picks(
            self.target,
            [plan.requests[i] for i in drawn],
            [view[i][1] for i in drawn],
            [view[i][2] for i in drawn],
            [hidden[offsets[i] : offsets[i + 1]] for i in drawn],
            [drafts[i] for i in drawn],
            q,
        )
        for i, p in zip(drawn, new):
            picks[i] = p
