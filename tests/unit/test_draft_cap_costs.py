"""The draft cost of a timed shape (refengine/spec_decode/step_costs.py, CostModel._observe_draft): its start-up
replay plus X(bucket), what a real draft adds to a replay, one line fitted over every draft sample of every
shape. So the score caps of a bucket keep the differences their replays measured, and a few slow steps at one
shape cannot price it above a wider one. Checked against the H200's real draft times by shape (run 126), and
on the trap this fixes (runs 125-127, docs/PERF.md): at c32 on the sharegpt profile, a few slow cap-4 drafts
made spans of 4 look dearer than spans of 5, and the policy stopped choosing (and so measuring) cap 4.

Run: python -m pytest tests/unit/test_draft_cap_costs.py -q
"""

from __future__ import annotations

from refengine.runner.graph_setup import draft_score_caps
from refengine.runner.shapes import batch_buckets, row_caps
from refengine.spec_decode.acceptance_estimate import table_from_rates
from refengine.spec_decode.span_choice import choose_spans
from refengine.spec_decode.step_costs import SPIKE, CostModel

B = 16
CAPS = draft_score_caps(B)  # (4, 8, 16)
# H200, Qwen3-4B shapes (run 126, process a): each draft shape's start-up replay and the median of its real
# draft times (ms), by (bucket, score cap); 16 is the full block's shape
REPLAY_MS = {
    1: (0.8925, 0.8982, 0.9098), 2: (0.8943, 0.9058, 0.9129), 4: (0.9247, 0.9272, 0.9385),
    8: (0.961, 0.9724, 0.996), 16: (1.1376, 1.1454, 1.1861), 24: (1.3415, 1.3943, 1.5826),
    32: (1.531, 1.5961, 1.8248),
}  # fmt: skip
REAL_MS = {
    1: (1.193, 1.198, 1.182), 2: (1.244, 1.303, 1.284), 4: (1.336, 1.349, 1.406), 8: (1.529, 1.521, 1.542),
    16: (1.934, 1.922, 2.007), 24: (2.221, 2.309, 2.472), 32: (2.501, 2.670, 2.914),
}  # fmt: skip


def _score_cap(widest: int) -> int | None:
    """The runner's draft_score_cap: the least cap holding the largest span (None: the full block's)."""
    cap = next(c for c in CAPS if c >= widest)
    return None if cap == B else cap


def _graph_rows(n: int, rows: int) -> int:
    """The GPU verify graphs' executed rows: bucket x the smallest row cap holding the rows."""
    bucket = next(b for b in batch_buckets(32) if b >= n)
    need = rows + bucket - n
    return bucket * next(c for c in row_caps(B) if bucket * c >= need)


def _seeded() -> CostModel:
    """A cost model as Engine.capture_graphs leaves it at Qwen3-4B shapes on the H200: the draft caps' replays,
    and verify / plain tables at run 125's measured times (ms)."""
    m = CostModel()
    m.bucket = m.draft_bucket = lambda n: next(b for b in batch_buckets(32) if b >= n)
    m.draft_cap = _score_cap
    for b, times in REPLAY_MS.items():
        for cap, t in zip(CAPS, times):
            m.seed("draft", _key(b, cap), t * 1e-3)
    for rows, t in ((64, 4.533), (128, 4.839), (256, 6.083), (512, 9.045)):
        m.seed("verify", (32, rows), t * 1e-3)
    m.seed("plain", 32, 4.703e-3)
    return m


def _draft_ms(m: CostModel, bucket: int) -> list[float]:
    return [m.draft_s(bucket, widest) * 1e3 for widest in CAPS]


def _key(bucket: int, cap: int):
    return bucket if cap == B else (bucket, cap)


def test_real_drafts_are_their_replays_plus_one_line_over_buckets():
    """Fed run 126's real times shape by shape (as a run's mix of shapes would come), every shape is priced
    within 0.15 ms of its measured median (0.05 on average), shapes it never saw included; a bucket's caps keep
    their replays' order."""
    m = _seeded()
    seen = [(b, cap) for b in REAL_MS for cap in CAPS if (b, cap) != (16, 4)]  # bucket 16's cap 4: never sampled
    for _ in range(6):
        for b, cap in seen:
            t = REAL_MS[b][CAPS.index(cap)]
            m.observe(b, b * cap, b, t * 1e-3, 4.8e-3, widest=cap)
    errors = [(abs(m.draft_s(b, cap) * 1e3 - REAL_MS[b][i]), b, cap) for b in REAL_MS for i, cap in enumerate(CAPS)]
    worst, mean = max(errors), sum(e for e, _, _ in errors) / len(errors)
    # a line over buckets: the medians bend a little (bucket 16 sits 0.1 ms above it), caps agree within 0.1
    assert worst[0] < 0.15 and mean < 0.05, (
        f"worst shape (bucket {worst[1]}, cap {worst[2]}) priced {worst[0]:.3f} ms off; mean {mean:.3f} ms"
    )
    for b in REAL_MS:
        priced = _draft_ms(m, b)
        assert priced == sorted(priced), (b, priced)


def test_slow_steps_at_one_cap_never_price_it_above_a_wider_cap():
    m = _seeded()
    for t in (2.50, 2.65, 2.52, 2.61, 2.49):  # real steps alternate caps 4 and 8 (~2.5-2.7 ms at c32, run 126)
        m.observe(32, 128, 32, t * 1e-3, 4.8e-3, widest=4)
        m.observe(32, 256, 32, (t + 0.1) * 1e-3, 6.08e-3, widest=5)
    for _ in range(3):  # slow cap-4 steps (a collector pass, a host stall), each counted up to SPIKE x
        m.observe(32, 128, 32, SPIKE * 10e-3, 4.8e-3, widest=4)
    cap4, cap8, full = _draft_ms(m, 32)
    assert cap4 < cap8 < full, (cap4, cap8, full)
    assert _draft_ms(m, 24)[0] < cap4, (_draft_ms(m, 24), cap4)


def test_c32_sharegpt_keeps_spans_of_four_after_slow_cap_four_steps():
    """The run 127 trap: 32 requests accepting as the sharegpt profile does at c32 (per-position rates of run
    125's policy), each with 100 tokens to go. After a few slow cap-4 drafts the search must still choose
    spans of 4 for all 32 (cap 4's graph, the verify shape of 128 rows): not spans of 5, not 24 of them drafting
    (bucket 24, never slowed down, then looked 1.5 ms cheaper), not plain decode."""
    rates = [0.665, 0.555, 0.49, 0.65, 0.49, 0.456, 0.407, 0.459, 0.486] + [0.324] * 6
    tables = [table_from_rates(rates)] * 32
    m = _seeded()
    for t in (2.50, 2.65, 2.52, 2.61, 2.49):  # real steps, of 32 drafting requests and of 24 (run 126: ~2.2 ms)
        m.observe(32, 128, 32, t * 1e-3, 4.84e-3, widest=4)
        m.observe(32, 256, 32, (t + 0.1) * 1e-3, 6.08e-3, widest=5)
        m.observe(32, 128, 24, (t - 0.3) * 1e-3, 4.84e-3, widest=5)
    calm = choose_spans(tables, [100] * 32, B, m, _graph_rows)
    for _ in range(3):
        m.observe(32, 128, 32, SPIKE * 10e-3, 4.84e-3, widest=4)
    after = choose_spans(tables, [100] * 32, B, m, _graph_rows)
    for d in (calm, after):  # alike requests, real costs (bucket 24's draft ~0.3 ms under 32's): all of them at 4
        assert d.spans == [4] * 32, (d.cap, d.spans, d.predicted_tok_per_s, d.plain_tok_per_s)
    assert after.predicted_tok_per_s > after.plain_tok_per_s, after
