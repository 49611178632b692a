"""Committing a step's result (the policy is in refengine/scheduler.py's docstring): commit() applies a
validated result to requests, KV pool, proposer and adaptive policy, then retires finished requests and checks
the others. Mixed into the Scheduler, over StepRecovery (which undoes a failed one)."""

from __future__ import annotations

from collections import Counter

from refengine.errors import AlignmentError, IntegrityError
from refengine.plan import DecodePlan, Plan, PrefillPlan, StepResult
from refengine.request import FinishReason, Request
from refengine.scheduler_recovery import StepRecovery
from refengine.spec_decode.accept import build_verify_results
from refengine.spec_decode.acceptance_profile import AcceptanceOverride
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.cost_samples import CostSamples
from refengine.spec_decode.plain_stretch import STRETCH_SAMPLE, PlainStretch
from refengine.spec_decode.shadow_probe import ShadowProbes


class StepCommit(StepRecovery):
    # what the Scheduler provides (beyond StepRecovery's)
    eos_ids: set[int]
    running: list[Request]
    span_counts: Counter
    policy: AdaptivePolicy | None
    costs: CostSamples | None
    acceptance_override: AcceptanceOverride | None
    _stretch: PlainStretch | None
    shadows: ShadowProbes

    # ---- commit ------------------------------------------------------------------------------------------
    def _append(self, req: Request, tokens: list[int] | tuple[int, ...]) -> None:
        for tok in tokens:
            req.output_ids.append(tok)
            if tok in self.eos_ids and not req.params.ignore_eos:
                req.finish(FinishReason.EOS)
                return
            if len(req.output_ids) >= req.params.max_tokens:
                req.finish(FinishReason.LENGTH)
                return

    def commit(self, plan: Plan, result: StepResult) -> None:
        """Apply a result the engine validated (plan.validate_result) to requests, pool and proposer."""
        if isinstance(plan, PrefillPlan):
            for i, req in enumerate(plan.requests):
                self.running.append(req)
                if result.topk:
                    req.topk.extend(result.topk[i])
                if plan.capture[i]:
                    self.active_proposer.commit_context(req.request_id, 0, len(req.prompt_ids))
                self._append(req, [result.argmax[i][-1]])
        elif isinstance(plan, DecodePlan):
            stretch = self._stretch_of(plan)
            if plan.capture:  # speculating requests given span 1: each row's features become context
                skip = plan.uncaptured
                captured = [r for r in plan.requests if r.request_id not in skip] if skip else plan.requests
                self.active_proposer.commit_step([r.request_id for r in captured])
                self.span_counts[1] += len(captured)
                if stretch is not None:
                    stretch.count_step()  # written into their stats when the stretch closes
                else:
                    for req in captured:
                        req.spec.record(1, 1)
            for i, req in enumerate(plan.requests):
                if result.topk:
                    req.topk.extend(result.topk[i])
                self._append(req, (result.argmax[i][-1],))
            if plan.shadow:
                self._open_shadows(plan, result)
            elif plan.capture and self.costs is not None:  # (a shadow's draft slowed the step: no sample)
                self.costs.take(plan, STRETCH_SAMPLE if stretch is not None else 1)
        else:
            ignore = [r.params.ignore_eos for r in plan.requests]
            if self.acceptance_override is None:
                results = build_verify_results(result.drafts, result.argmax, self.eos_ids, ignore)
            else:  # benchmark-only (refengine bench --acceptance-profile): m drawn from the profile
                forced = [self.acceptance_override.draw(r.request_id, s) for r, s in zip(plan.requests, plan.spans)]
                results = build_verify_results(result.drafts, result.argmax, self.eos_ids, ignore, accepted=forced)
            self.span_counts.update(plan.spans)
            for (req_id, start, span), req, vr in zip(
                self.pool.speculative_view(plan.reservation), plan.requests, results
            ):
                self.pool.apply_speculative(req_id, vr.committed, plan.reservation)
                if req_id not in plan.uncaptured:  # (a retired request: span 1, no drafter context)
                    self.active_proposer.record_verify_dflash_context(req_id, start, vr.committed)
                    req.spec.record(vr.committed, span)
                if self.policy is not None:
                    self.policy.observe_acceptance(req_id, span, vr.accepted)
                self._append(req, vr.new_tokens)
            self.pool.revert_schedule(plan.reservation)
            if self.costs is not None:
                self.costs.take(plan)
        if self.shadows.open:
            self._settle_shadows(plan)
        self._retire_and_check(plan)
        if self.costs is not None and not self.running and not self.waiting:
            self.costs.feed()  # idle: no next step will hand the sample over

    def _open_shadows(self, plan: DecodePlan, result: StepResult) -> None:
        """The step's shadow probes begin: each block's drafts against the tokens from this step's on."""
        assert self.policy is not None
        for it, drafts in zip(plan.shadow, result.shadow_drafts):
            req = next(r for r in plan.requests if r.request_id == it.req_id)
            if self.acceptance_override is not None:  # benchmark-only: m drawn as for a verify of that span
                self.policy.observe_shadow(it.req_id, it.span, self.acceptance_override.draw(it.req_id, it.span))
            else:  # d_1 predicts the token this step committed (the request's current token was at it.start)
                self.shadows.start(it.req_id, it.start - len(req.prompt_ids) + 1, drafts, it.span)

    def _settle_shadows(self, plan: Plan) -> None:
        """Shadow probes of the plan's requests that its tokens decide: their answers go to the policy."""
        assert self.policy is not None
        for req in plan.requests:
            if req.request_id in self.shadows.open:
                got = self.shadows.settle(req.request_id, req.output_ids, req.finished)
                if got is not None:  # (a finished request's unanswered shadow: in flight until _drop releases it)
                    self.policy.observe_shadow(req.request_id, *got)

    def _stretch_of(self, plan: Plan) -> PlainStretch | None:
        """The open plain stretch when `plan` is one of its steps."""
        stretch = self._stretch
        return stretch if stretch is not None and plan.requests is stretch.requests else None

    def close_stretch(self) -> None:
        """Write the open plain stretch's steps into its requests' SpecStats and end it (a no-op without one)."""
        stretch, self._stretch = self._stretch, None
        if stretch is not None:
            stretch.close()
            if self.costs is not None:
                self.costs.flush_decodes(stretch.size)

    def _retire_and_check(self, plan: Plan) -> None:
        """Release the plan's finished requests; the others' KV and drafter context must match what they
        committed (IntegrityError / AlignmentError otherwise: a bug, which the engine turns into abandon())."""
        finished = [req for req in plan.requests if req.finished]
        if finished:  # out of `running` in one pass: per request it was O(n^2) at a wave's end
            gone = {req.request_id for req in finished}
            self.running = [r for r in self.running if r.request_id not in gone]
            for req in finished:
                self._drop(req, queues=False)
                self._done.append(req)
        seq_len = self.pool.seq_len
        # a decode plan needs no drafter check: commit_step appended each captured row only where its request's
        # context ended (so it now ends at the new KV length), and a decode plan that captures nothing holds no
        # speculating request (~0.4 us a request a step; dev CPU, forward mocked, c32: 100 -> 87 us, plain 78)
        context_rows = (
            self.proposer.context_rows if self.proposer is not None and not isinstance(plan, DecodePlan) else None
        )
        for req in plan.requests:
            if req.finished:
                continue
            kv = seq_len[req.request_id]
            if kv != req.committed_len:
                raise IntegrityError(f"request {req.request_id}: KV length {kv} != committed {req.committed_len}")
            if context_rows is not None and self.speculates(req) and context_rows(req.request_id) != kv:
                raise AlignmentError(
                    f"request {req.request_id}: drafter context rows "
                    f"{self.active_proposer.context_rows(req.request_id)} != committed KV length {kv}"
                )
