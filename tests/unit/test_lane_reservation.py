"""The tight ("lane") DFlash reservation never under-reserves what the engine's drafter lane allocates,
measured on CPU tensors: at every step of a concurrent run, the lane's persistent bytes (context K/V
buffers plus pending target features of every live request) stay within the reservation's per-token bytes
times the tokens the pool bills for those requests.

Run: pytest tests/unit/test_lane_reservation.py
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from refengine.memory import DFlashMemoryReservation
from tests.adapter import cpu_engine


@pytest.mark.parametrize("accounting", ["lane", "upstream"])
def test_lane_persistent_bytes_within_reservation(random_pair, accounting):
    engine = cpu_engine(random_pair.target, random_pair.draft)
    res = DFlashMemoryReservation.from_config(
        random_pair.target, random_pair.draft, page_size=16, max_decode_batch=8, dtype_bytes=4, accounting=accounting
    )
    budgets = [(5, 1), (40, 17), (1, 30), (100, 3), (17, 16), (64, 40)]
    reqs = [engine.add_request([3] * p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in budgets]
    worst = 0.0
    while engine.has_work():
        engine.step()
        live = [r for r in reqs if r.request_id in engine.proposer.live_requests()]
        held = engine.proposer.persistent_bytes()
        # per-token bytes over what the pool bills, plus each live request's share of the block headroom
        # (the B scratch rows past its lifetime where the drafter writes the block's own K/V)
        billed = (
            res.per_token_bytes * res.pool_billed_tokens([len(r.prompt_ids) + r.params.max_tokens for r in live])
            + res.block_headroom_bytes * len(live) // res.max_decode_batch
        )
        assert held <= billed, f"{accounting}: lane holds {held:,} B for {len(live)} requests, reserved {billed:,} B"
        worst = max(worst, held / billed if billed else 0.0)
    # the tight accounting must also be tight: right after a prefill the lane holds nearly all it bills
    floor = 0.6 if accounting == "lane" else 0.2
    assert worst > floor, f"{accounting}: max held/reserved only {worst:.2f}: is it measuring the lane?"
    print(f"{accounting}: max held/reserved {worst:.3f}")
