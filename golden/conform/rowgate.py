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
from golden.gates import HEAD_TOP_N, Delta, GateReport, Tolerances, finish_head_deltas, gate_position
from golden.records import TopKRecord


def string_row_gate(
    engine: Sequence[ScoredSequence], hf: Sequence[TopKRecord], tol: Tolerances, worst_n: int = 5
) -> tuple[GateReport, int]:
    """(the gate report, rows with fewer than HEAD_TOP_N entries), engine sequences paired with hf by order."""
    report = GateReport(tol=tol)
    narrow = 0
    deltas: list[Delta] = []
    if len(engine) != len(hf):
        raise CoverageError(f"{len(engine)} engine sequences for {len(hf)} HF records")
    for seq, ref in zip(engine, hf):
        if seq.token_ids != ref.token_ids:
            raise CoverageError(f"{seq.name}: engine ids differ from HF's {ref.name}")
        for p, row in enumerate(seq.rows):
            narrow += len(row.ids) < HEAD_TOP_N
            gate_position(report, deltas, seq.name, p, ref, row.argmax, row.ids, row.lps)
    finish_head_deltas(report, deltas, worst_n)
    return report, narrow
