"""Committing a step's result (the failure policy is in scheduler/scheduler.py's docstring): commit() applies
a validated result to requests, KV pool and proposer, reports a drafting step to the span policy, then
releases finished requests and checks the others. Mixed into the Scheduler, over StepRecovery."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

from refengine.errors import AlignmentError, IntegrityError
from refengine.plan import DecodePlan, Plan, PrefillPlan, StepResult, VerifyPlan
from refengine.request import FinishReason, Request
from refengine.scheduler.recovery import StepRecovery
from refengine.span_policy.base import SpanPolicy, StepReport
from refengine.spec_decode.accept import build_verify_results
from refengine.spec_decode.acceptance_profile import AcceptanceOverride

log = logging.getLogger(__name__)


class StepCommit(StepRecovery):
    # what the Scheduler provides (beyond StepRecovery's)
    eos_ids: set[int]
    running: list[Request]
    span_counts: Counter
    acceptance_override: AcceptanceOverride | None
    policy_errors: int
    _step_report: StepReport | None  # the committed drafting step's, until report_step hands it over

    def _register(self, req: Request) -> None:
        raise NotImplementedError

    @property
    def active_policy(self) -> SpanPolicy:
        raise NotImplementedError

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
                    cached = plan.cached_tokens(i)  # rows of cached blocks: their features are in the store
                    if cached:
                        self.active_proposer.attach_cached(req.request_id, cached)
                    self.active_proposer.commit_context(req.request_id, cached, len(req.prompt_ids) - cached)
                if self.pool.prefix_cache is not None:  # counted once committed: a retried prefill looks up again
                    self.pool.prefix_cache.record_lookup(len(req.prompt_ids), plan.cached_tokens(i))
                self._append(req, [result.argmax[i][-1]])
        elif isinstance(plan, DecodePlan):
            if plan.capture:  # drafting requests at span 1: each row's features become drafter context
                n = len(plan.requests)
                self.active_proposer.commit_step([r.request_id for r in plan.requests])
                for req in plan.requests:
                    req.spec.record(1, 1)
                self.span_counts[1] += n
                self._report(plan, [1] * n, [0] * n, result)
            for i, req in enumerate(plan.requests):
                if result.topk:
                    req.topk.extend(result.topk[i])
                self._append(req, (result.argmax[i][-1],))
        else:
            self._commit_verify(plan, result)
        self._release_and_check(plan)

    def _commit_verify(self, plan: VerifyPlan, result: StepResult) -> None:
        ignore = [r.params.ignore_eos for r in plan.requests]
        if self.acceptance_override is None:
            results = build_verify_results(result.drafts, result.argmax, self.eos_ids, ignore)
        else:  # benchmark-only (refengine bench --acceptance-profile): m drawn from the profile
            forced = [self.acceptance_override.draw(r.request_id, s) for r, s in zip(plan.requests, plan.spans)]
            results = build_verify_results(result.drafts, result.argmax, self.eos_ids, ignore, accepted=forced)
        for (req_id, start, span), req, vr in zip(self.pool.speculative_view(plan.reservation), plan.requests, results):
            self.pool.apply_speculative(req_id, vr.committed, plan.reservation)
            self.active_proposer.record_verify_dflash_context(req_id, start, vr.committed)
            req.spec.record(vr.committed, span)
            self._append(req, vr.new_tokens)
        self.pool.revert_schedule(plan.reservation)
        self.span_counts.update(plan.spans)
        self._report(plan, plan.spans, [vr.accepted for vr in results], result)

    def _report(self, plan: Plan, spans: list[int], accepted: list[int], result: StepResult) -> None:
        ids = tuple(r.request_id for r in plan.requests)
        self._step_report = StepReport(ids, tuple(spans), tuple(accepted), result.seconds, result.draft_seconds)

    def report_step(self, host_s: float | None) -> None:
        """Hand the committed drafting step's outcome to the span policy, its time the step's whole wall time:
        the runner's plus `host_s`, the engine's scheduling, checks and commit around it (the host's share of a
        step differs by kind, and on a fast device it decides which kind is cheaper). Called by Engine.step
        after the commit, so requests that finished in the step have been released. A policy whose observe
        raises is logged and counted (policy_errors): the step is committed and stays so."""
        report, self._step_report = self._step_report, None
        if report is None:
            return
        if report.seconds is not None and host_s is not None:
            report = dataclasses.replace(report, seconds=report.seconds + host_s)
        try:
            self.active_policy.observe(report)
        except Exception as e:
            self.policy_errors += 1
            log.warning("the span policy's observe failed (%s: %s)", type(e).__name__, e)

    def _release_and_check(self, plan: Plan) -> None:
        """Release the plan's finished requests; the others' KV and drafter context must match what they
        committed (IntegrityError / AlignmentError otherwise: a bug, which the engine turns into abandon()).
        Each request's full committed blocks go into the prefix cache, if on (the others' once checked)."""
        finished = [req for req in plan.requests if req.finished]
        if finished:  # out of `running` in one pass (one at a time is quadratic at a wave's end)
            gone = {req.request_id for req in finished}
            self.running = [r for r in self.running if r.request_id not in gone]
            for req in finished:
                self._register(req)
                self._drop(req, queues=False)
                self._done.append(req)
        seq_len = self.pool.seq_len
        # a decode plan needs no drafter check: commit_step appended each row where its request's context ended
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
            self._register(req)  # its full committed blocks into the prefix cache (a no-op without one)
