"""The HF gate over rows read from token strings (parse.Row), some narrowed by colliding strings.

golden/gates.py hf_gate needs k >= 8 ids in every engine row. A server's OpenAI `top_logprobs` is a
{token string: logprob} object, and several ids can decode to one string (byte tokens all read U+FFFD), so a
row can come back narrower than asked, its argmax known only as a set of candidates. This gate applies
hf_gate's definitions (the argmax's regret against the HF row within the margin; head deltas |engine lp - HF
lp| over the engine's top-8 entries, a token outside HF's top-k scored against HF's k-th) with an ambiguous
argmax scored by its best candidate (a lower bound on its regret), and counts the narrowed rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from golden.conform.parse import ScoredSequence
from golden.errors import CoverageError
from golden.gates import HEAD_TOP_N, GateReport, Tolerances, Violation, _percentile, _regret
from golden.records import TopKRecord


def string_row_gate(
    engine: Sequence[ScoredSequence], hf: Sequence[TopKRecord], tol: Tolerances, worst_n: int = 5
) -> tuple[GateReport, int]:
    """(the gate report, rows with fewer than HEAD_TOP_N entries), engine sequences paired with hf by order."""
    report = GateReport(tol=tol)
    narrow = 0
    deltas: list[tuple[float, str, int, int]] = []
    if len(engine) != len(hf):
        raise CoverageError(f"{len(engine)} engine sequences for {len(hf)} HF records")
    for seq, ref in zip(engine, hf):
        if seq.token_ids != ref.token_ids:
            raise CoverageError(f"{seq.name}: engine ids differ from HF's {ref.name}")
        for p, row in enumerate(seq.rows):
            h_ids, h_lps = ref.topk_ids[p], ref.topk_logprobs[p]
            narrow += len(row.ids) < HEAD_TOP_N
            regret, in_topk, pick = min((*_regret(h_ids, h_lps, c), c) for c in row.argmax)
            report.max_regret = max(report.max_regret, regret)
            if not in_topk or regret > tol.margin:
                report.violations.append(Violation(seq.name, p, pick, h_ids[0], regret, in_topk))
            for tok, e_lp in zip(row.ids[:HEAD_TOP_N], row.lps[:HEAD_TOP_N]):
                h_lp = ref.logprob_of(p, tok)
                if h_lp is None:
                    report.missing_from_hf += 1
                    h_lp = h_lps[-1]
                deltas.append((abs(e_lp - h_lp), seq.name, p, tok))
            report.positions += 1
    values = [d[0] for d in deltas]
    if values:
        report.mean = sum(values) / len(values)
        report.p99 = _percentile(values, 99)
        report.max = max(values)
        report.worst = sorted(deltas, key=lambda d: -d[0])[:worst_n]
    return report, narrow
