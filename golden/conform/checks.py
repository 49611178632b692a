"""The conformance checks, one function each; every one returns a CheckResult (pass, fail, skip or report).

- topk: the HF gate (golden/gates.py hf_gate) on teacher-forced top-k rows scored by the server (`echo` +
  `logprobs` + max_tokens 1: the prompt's rows, then the generated token's row), twice: the golden sequences
  against the stored rows, then each prompt re-used with its continuation reversed against live HF rows
  (a server that serves stale rows for a re-used prompt fails the second pass).
- greedy: each golden prompt generated greedily, gated against HF greedy by the first-divergence regret gate
  (HF scores the divergence; reanchored, so every later token is gated too).
- concurrency: prompts with staggered max_tokens, first solo in ascending budget order (short then long: a
  stale captured graph or a batch-size-keyed buffer shows), then the shorter half at once, then all at once;
  each output is gated against its solo ids run by the (text) regret gate.
- baseline: spec on (--url) against spec off (--baseline-url), prompt by prompt, by the regret gate; at a
  divergence both picks (spec's and baseline's) must be within the band, so either side being wrong fails.
- acceptance: tau over the greedy run from the server's /metrics before and after, against the acceptance
  golden's tau within a relative tolerance; skipped against an adaptive span policy (its tau is the policy's).
- sampling (golden/conform/sampling.py): seeded sampled completions without logprobs (so a speculative
  server speculates) with vLLM's `return_token_ids`, enough of them for the distribution gate's powered
  sample size; their ids teacher-forced through HF into the oracle's conditionals and gated by
  golden.distribution.gate.distribution_gate (KS, chi-square, impossible tokens). Skipped when the answers
  carry no `token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from golden.conform.client import Server, ServerError, run_concurrently
from golden.conform.parse import ResponseError, ScoredSequence, TokenMap, generated_ids, scored_sequence
from golden.conform.prom import SpecCounters, TauWindow, tau_between
from golden.conform.rowgate import string_row_gate
from golden.conform.source import GoldenSource
from golden.conform.textgate import text_regret_gate
from golden.gates import (
    HEAD_TOP_N,
    MARGIN_TOL,
    RegretReport,
    Tolerances,
    Violation,
    _regret,
    first_divergence_regret_gate,
)
from golden.records import GreedyRecord, TopKRecord

PASS, FAIL, SKIP, REPORT = "pass", "fail", "skip", "report"
BUDGETS = (1, 2, 15, 16, 17, 31, 33, 64)
LISTED = 5  # failing records listed per check


@dataclass
class CheckResult:
    name: str
    status: str
    summary: str
    details: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join([f"[{self.status.upper()}] {self.name}: {self.summary}", *("    " + d for d in self.details)])


@dataclass
class Context:
    """What every check shares: the server, its kind, the golden source, the token map, the regret band."""

    server: Server
    kind: str  # refengine, vllm, sglang, unknown
    source: GoldenSource
    tmap: TokenMap
    margin: float = MARGIN_TOL
    greedy_outputs: dict[str, list[int]] = field(default_factory=dict)  # ids runs, filled by the greedy check
    greedy_texts: dict[str, str] = field(default_factory=dict)  # text-only runs, filled by the greedy check
    tau: TauWindow | None = None  # filled by the greedy check

    @property
    def extras(self) -> dict:
        """Request fields that make this server's answers exact (vLLM: ids instead of token strings)."""
        return {"return_tokens_as_token_ids": True} if self.kind == "vllm" else {}

    def generate(self, server: Server, rec: GreedyRecord, max_tokens: int, logprobs: bool = True) -> dict:
        """A greedy run of rec's prompt; with logprobs 1 its token ids can be read, without it only its text."""
        body: dict = {"prompt": rec.prompt_ids, "max_tokens": max_tokens, "temperature": 0}
        if logprobs:
            body["logprobs"] = 1
        return server.complete({**body, **self.extras})


STRICT_KINDS = ("refengine", "vllm")  # their docs promise echo + logprobs: an unreadable answer is a failure


def guarded(name: str, ctx: Context, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run a check. An answer the check cannot read (missing fields, an HTTP error) fails it on a server whose
    docs promise the fields (STRICT_KINDS), and skips it, with the reason, on any other (SGLang, unknown),
    whose API may simply not offer them."""
    try:
        return fn()
    except (ResponseError, ServerError, KeyError, TypeError, ValueError) as e:  # a malformed answer included
        if ctx.kind not in STRICT_KINDS:
            return CheckResult(name, SKIP, f"the server's answers do not support this check ({ctx.kind}): {e}")
        return CheckResult(name, FAIL, f"{type(e).__name__}: {e}")


def _score(ctx: Context, name: str, ids: Sequence[int], k: int) -> ScoredSequence:
    body = {"prompt": list(ids), "max_tokens": 1, "echo": True, "logprobs": k, "temperature": 0}
    return scored_sequence(name, ctx.server.complete({**body, **ctx.extras}), ids, ctx.tmap)


def check_topk(ctx: Context, tol: Tolerances) -> CheckResult:
    src = ctx.source
    k = min(src.topk[0].k, 20)
    engine = [_score(ctx, r.name, r.token_ids, k) for r in src.topk]
    golden_pass, narrow = string_row_gate(engine, src.topk, tol)
    reused_eng, reused_hf = [], []
    for g in src.greedy:
        ids = g.prompt_ids + g.output_ids[::-1]
        ref = src.score_record(ids)
        ref = TopKRecord(g.name + "/reused", ids, ref.topk_ids, ref.topk_logprobs)
        reused_hf.append(ref)
        reused_eng.append(_score(ctx, ref.name, ids, k))
    reused_pass, narrow2 = string_row_gate(reused_eng, reused_hf, tol)
    ok = golden_pass.passed and reused_pass.passed
    summary = (
        f"golden sequences: {golden_pass.positions} positions, head delta mean {golden_pass.mean:.6f} "
        f"p99 {golden_pass.p99:.6f}, max regret {golden_pass.max_regret:.6f}, {len(golden_pass.violations)} "
        f"violations; re-used prompts: {reused_pass.positions} positions, mean {reused_pass.mean:.6f}, "
        f"max regret {reused_pass.max_regret:.6f}, {len(reused_pass.violations)} violations; "
        f"ambiguous token strings {ctx.tmap.ambiguous} (top-k entries left out: {ctx.tmap.dropped}), "
        f"rows narrowed below {HEAD_TOP_N} by colliding strings {narrow + narrow2}"
    )
    details = [] if ok else [*str(golden_pass).splitlines(), *str(reused_pass).splitlines()]
    data = {
        "positions": golden_pass.positions + reused_pass.positions,
        "mean": golden_pass.mean,
        "p99": golden_pass.p99,
        "max_regret": max(golden_pass.max_regret, reused_pass.max_regret),
        "violations": len(golden_pass.violations) + len(reused_pass.violations),
        "narrow_rows": narrow + narrow2,
    }
    return CheckResult("topk", PASS if ok else FAIL, summary, details, data)


def _regret_summary(name: str, reports: Sequence[RegretReport], what: str) -> CheckResult:
    failed = [r for r in reports if not r.passed]
    diverged = [r for r in reports if r.first_divergence is not None]
    worst = max((r.max_regret for r in reports), default=0.0)
    summary = (
        f"{len(reports)} {what}: {len(reports) - len(diverged)} token-equal, {len(diverged)} diverged, "
        f"{len(failed)} over the regret band; max regret {worst:.6f}"
    )
    data = {"requests": len(reports), "diverged": len(diverged), "failed": len(failed), "max_regret": worst}
    details = [line for r in failed[:LISTED] for line in str(r).splitlines()]
    return CheckResult(name, FAIL if failed else PASS, summary, details, data)


def _text(resp: dict) -> str:
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0].get("text"), str):
        raise ResponseError(f"answer has no choices[0].text: {str(resp)[:200]}")
    return choices[0]["text"]


def check_greedy(ctx: Context) -> CheckResult:
    """Ids runs (logprobs 1) gated against HF greedy, then text-only runs (the path a server may reserve for
    speculation) gated against the ids runs' text; /metrics is read around the text-only runs."""
    src = ctx.source
    reports = []
    ids_runs: dict[str, tuple[list[int], str]] = {}
    for g in src.greedy:
        resp = ctx.generate(ctx.server, g, len(g.output_ids))
        out = generated_ids(resp, ctx.tmap, g.output_ids)
        ids_runs[g.name] = (out, _text(resp))
        ctx.greedy_outputs[g.name] = out
        reports.append(
            first_divergence_regret_gate(g.prompt_ids, g.output_ids, out, src.score, ctx.margin, name=g.name)
        )
    before = SpecCounters.read(ctx.server.metrics())
    for g in src.greedy:
        text = _text(ctx.generate(ctx.server, g, len(g.output_ids), logprobs=False))
        ctx.greedy_texts[g.name] = text
        ids, ref_text = ids_runs[g.name]
        reports.append(
            text_regret_gate(g.prompt_ids, ids, ref_text, text, src.score, ctx.tmap, ctx.margin, g.name + "/text")
        )
    ctx.tau = tau_between(before, SpecCounters.read(ctx.server.metrics()))
    return _regret_summary("greedy", reports, "runs (ids runs vs HF greedy, text-only runs vs the ids runs)")


def check_concurrency(ctx: Context, budgets: Sequence[int] = BUDGETS) -> CheckResult:
    src = ctx.source
    recs = [src.greedy[i % len(src.greedy)] for i in range(len(budgets))]
    order = sorted(range(len(budgets)), key=lambda i: budgets[i])
    solo: dict[int, tuple[list[int], str]] = {}
    reports = []
    for i in order:  # short then long, ids run then text-only run
        resp = ctx.generate(ctx.server, recs[i], budgets[i])
        solo[i] = (generated_ids(resp, ctx.tmap), _text(resp))
        text = _text(ctx.generate(ctx.server, recs[i], budgets[i], logprobs=False))
        name = f"{recs[i].name}@max_tokens={budgets[i]}/solo"
        reports.append(text_regret_gate(recs[i].prompt_ids, *solo[i], text, src.score, ctx.tmap, ctx.margin, name))
    # bursts: the shorter half at once, then all at once (a batch shape captured for the first must not serve
    # the second)
    short = order[: max(1, len(order) // 2)]
    for label, group in (("short-burst", short), ("burst", list(range(len(budgets))))):
        bodies = [
            {"prompt": recs[i].prompt_ids, "max_tokens": budgets[i], "temperature": 0, **ctx.extras} for i in group
        ]
        for i, resp in zip(group, run_concurrently(ctx.server, bodies)):
            name = f"{recs[i].name}@max_tokens={budgets[i]}/{label}"
            reports.append(
                text_regret_gate(recs[i].prompt_ids, *solo[i], _text(resp), src.score, ctx.tmap, ctx.margin, name)
            )
    what = f"runs (max_tokens {list(budgets)}: solo short to long, the shorter half at once, all at once) vs solo"
    return _regret_summary("concurrency", reports, what)


def check_baseline(ctx: Context, baseline: Server | None) -> CheckResult:
    if baseline is None:
        return CheckResult("baseline", SKIP, "no --baseline-url: spec on vs spec off not compared")
    reports = []
    for g in ctx.source.greedy:
        spec_text = ctx.greedy_texts.get(g.name)
        if spec_text is None:
            return CheckResult("baseline", SKIP, "the greedy check did not run: no spec-on outputs to compare")
        resp = ctx.generate(baseline, g, len(g.output_ids))
        base = generated_ids(resp, ctx.tmap, g.output_ids)
        rep = text_regret_gate(
            g.prompt_ids, base, _text(resp), spec_text, ctx.source.score, ctx.tmap, ctx.margin, g.name
        )
        j = rep.first_divergence
        if j is not None:  # symmetric: the baseline's own pick at the divergence must be within the band too
            row = ctx.source.score_record(g.prompt_ids + base[:j])
            regret, in_topk = _regret(row.topk_ids[-1], row.topk_logprobs[-1], base[j])
            rep.max_regret = max(rep.max_regret, regret)
            if regret > ctx.margin:
                rep.violations.append(
                    Violation(g.name + " (baseline pick)", j, base[j], row.topk_ids[-1][0], regret, in_topk)
                )
        reports.append(rep)
    what = "text-only runs with spec on vs the --baseline-url ids runs (both picks gated at a divergence)"
    return _regret_summary("baseline", reports, what)


def check_acceptance(ctx: Context, rel_tol: float) -> CheckResult:
    w = ctx.tau
    if w is None:
        return CheckResult("acceptance", SKIP, "the greedy check did not run: no window to read tau over")
    if w.tau is None:
        return CheckResult("acceptance", SKIP, w.reason, data={"steps": w.steps})
    if w.adaptive:  # spans chosen per step (some decoded plainly): the window's tau is the policy's
        return CheckResult(
            "acceptance",
            SKIP,
            f"the server chooses spans per step (--speculation adaptive; {w.plain_steps:.0f} of {w.steps:.0f} verify "
            f"steps decoded plainly): tau {w.tau:.4f} is the policy's, not the drafter's; gate acceptance against "
            "fixed speculation (refengine serve's default)",
            data={"tau": w.tau, "verify_steps": w.steps, "plain_steps": w.plain_steps},
        )
    names = {g.name for g in ctx.source.greedy}
    acc = [a for a in ctx.source.acceptance if a.name in names]
    steps = sum(len(a.accepted_lengths) for a in acc)
    data = {"tau": w.tau, "verify_steps": w.steps, "committed": w.committed}
    if not steps:
        return CheckResult(
            "acceptance", REPORT, f"tau {w.tau:.4f} over {w.steps:.0f} verify steps (no acceptance golden)", data=data
        )
    golden = sum(sum(a.accepted_lengths) for a in acc) / steps
    delta = (w.tau - golden) / golden
    ok = abs(delta) <= rel_tol
    summary = (
        f"tau {w.tau:.4f} over {w.steps:.0f} verify steps vs golden {golden:.4f} over {steps}: "
        f"relative delta {delta:+.4f} (tol {rel_tol})"
    )
    return CheckResult("acceptance", PASS if ok else FAIL, summary, data={**data, "golden_tau": golden, "delta": delta})
