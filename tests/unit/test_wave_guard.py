"""The wave guard (refengine/spec_decode/wave_guard.py): a closed batch the adaptive policy ran awake is judged
at its end, its chosen steps' modelled time against plain decode's for the same tokens; one that lost by more
than GUARD_MARGIN holds the closed batches of its size and larger ones plain (admitted retired) for a while,
re-tested at doubling intervals. Checks the verdict's arithmetic, the hold's reach and release, that open
batches (steady arrivals) and short ones are never judged, the engine's wiring (the scheduler's generated
tokens), and the trained tiny pair's replayed bench (tests/unit/trained_pair_replay.py) where it was written for.

Run: python -m pytest tests/unit/test_wave_guard.py -q
"""

from __future__ import annotations

import itertools

from refengine.request import SamplingParams
from refengine.spec_decode.wave_guard import (
    FIRST_HOLD,
    GUARD_MARGIN,
    LOSSES_TO_HOLD,
    MIN_JUDGED,
    WaveGuard,
    _plain_time,
)
from tests.adapter import cpu_engine
from tests.unit.test_adaptive import _simulate_phases
from tests.unit.trained_pair_replay import median, replay_bench

PLAIN_S = 1e-3  # a plain step, whatever the batch (the verdicts below are ratios of such steps)
_REQ_IDS = itertools.count()


def _bucket(n: int) -> int:
    return next(b for b in (1, 2, 4, 8, 16, 24, 32) if b >= n)


def _wave(guard: WaveGuard, n: int, tokens: int, step_s: float, key: object, unseen: bool = True) -> bool:
    """A closed batch of n requests, each generating `tokens`, every decode step chosen by the span search at
    `step_s` and committing one token a request: whether it was held."""
    ids = [next(_REQ_IDS) for _ in range(n)]
    held = [guard.admit(r, tokens, n, n, (key,), lambda: unseen) for r in ids]
    assert len(set(held)) == 1, f"one verdict a batch: {held}"
    if not held[0]:
        for t in range(tokens - 1):
            guard.step(ids, [tokens - 1 - t] * n, step_s, True)
    for i, r in enumerate(ids):
        guard.release(r, None, n - 1 - i, lambda m: PLAIN_S)
    return held[0]


def test_the_verdict_is_the_chosen_steps_against_plain_decode():
    guard = WaveGuard(_bucket)
    _wave(guard, 8, 128, PLAIN_S, "plain")
    assert guard.judged == 1 and abs(guard.last_ratio - 1.0) < 1e-9, f"plain steps: ratio {guard.last_ratio}"
    assert guard.held_from is None
    _wave(guard, 8, 128, PLAIN_S * (1 + GUARD_MARGIN / 2), "a little dearer")
    assert guard.held_from is None, f"ratio {guard.last_ratio:.4f} within the margin held"
    for i in range(LOSSES_TO_HOLD):
        assert guard.held_from is None, f"held after {i} losses in a row: {guard.summary()}"
        _wave(guard, 8, 128, PLAIN_S * (1 + 2 * GUARD_MARGIN), ("dearer", i))
    assert guard.lost == LOSSES_TO_HOLD and guard.held_from == 8, f"ratio {guard.last_ratio:.4f}: {guard.summary()}"
    assert guard.summary()["ratios"][-1] == round(guard.last_ratio, 4)
    # plain decode's time shrinks with its batch: requests of 3, 5 and 5 steps at 1 ms a step
    assert abs(_plain_time({1: 3, 2: 5, 3: 5}, lambda m: 1e-3) - 5e-3) < 1e-12


def test_a_loss_holds_its_size_and_larger_ones_until_a_retest_does_not_lose():
    guard = WaveGuard(_bucket)
    for i in range(LOSSES_TO_HOLD):
        _wave(guard, 8, 128, 2 * PLAIN_S, ("first", i))
    assert guard.held_from == 8 and guard.held_left == FIRST_HOLD, guard.summary()
    assert not _wave(guard, 4, 128, PLAIN_S, 1), "a smaller batch is held"
    # where the policy's own plain regime holds the batch runs as the policy decides (a short one: not judged)
    assert not _wave(guard, 16, MIN_JUDGED, PLAIN_S, 2, unseen=False), "held where the policy's plain regime holds"
    held = [_wave(guard, c, 128, 2 * PLAIN_S, 3 + i) for i, c in enumerate([8, 16, 32])]
    assert held == [True, True, True] and guard.held_left == 0, f"held {held}, {guard.summary()}"
    assert not _wave(guard, 32, 128, 2 * PLAIN_S, 10), "the re-test ran held"
    assert guard.held_left == 2 * FIRST_HOLD, f"a losing re-test doubles the hold: {guard.summary()}"
    for i in range(2 * FIRST_HOLD):
        assert _wave(guard, 16, 128, 2 * PLAIN_S, 20 + i)
    _wave(guard, 16, 128, PLAIN_S, 40)  # the next re-test does not lose
    assert guard.held_from is None and not _wave(guard, 32, 128, PLAIN_S, 41), guard.summary()


def test_open_and_short_batches_are_not_judged():
    guard = WaveGuard(_bucket)
    _wave(guard, 8, MIN_JUDGED, 3 * PLAIN_S, "short")  # MIN_JUDGED tokens: MIN_JUDGED - 1 decode steps
    guard.admit(7, 128, 1, 1, ("looks",), lambda: True)  # a batch whose steps the search never chose to speculate
    guard.step([7], [127], 3 * PLAIN_S, False)
    guard.release(7, None, 0, lambda m: PLAIN_S)
    assert guard.judged == 0, guard.summary()
    guard.admit(1, 128, 1, 1, ("open",), lambda: True)
    guard.admit(2, 128, 2, 1, ("joins",), lambda: True)  # one more joins a running request: an open batch
    assert not guard.tracking
    guard.release(1, None, 1, lambda m: PLAIN_S)
    guard.release(2, None, 0, lambda m: PLAIN_S)
    assert guard.judged == 0, guard.summary()
    # steady arrivals in simulation: requests join running ones, no batch is closed
    policies: list = []
    _simulate_phases("adaptive", [(8, 0.3, 6, 128)], steady=True, policies=policies)
    assert policies[0].guard.judged == 0, policies[0].guard.summary()


def test_the_engine_hands_the_guard_its_closed_batches(trained_pair):
    # the scheduler's wiring, whatever the policy chooses on this machine's timings: both requests admitted as
    # one closed batch, each chosen step accounted, each release with the tokens the request ended with
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive", num_blocks=64)
    policy = engine.scheduler.policy
    assert policy is not None
    guard, seen = policy.guard, {"steps": 0, "released": {}}
    step, release = guard.step, guard.release

    def counting_step(*a, **k):
        seen["steps"] += 1
        return step(*a, **k)

    def recording_release(req_id, generated, live, plain_s):
        seen["released"][req_id] = (generated, live)
        return release(req_id, generated, live, plain_s)

    guard.step, guard.release = counting_step, recording_release  # type: ignore[method-assign]
    reqs = [
        engine.add_request([5 + i, 9, 13, 2 * i + 1], SamplingParams(max_tokens=MIN_JUDGED + 8 * i, ignore_eos=True))
        for i in range(2)
    ]
    engine.step()  # the prefill: one closed batch
    assert guard.tracking, guard.summary()
    while engine.has_work():
        engine.step()
    assert seen["steps"] >= 1, "no chosen step accounted"  # (a plain stretch reuses its choice: guard.reuse)
    generated = {r: g for r, (g, _) in seen["released"].items()}
    assert (
        generated
        == {r.request_id: len(r.output_ids) for r in reqs}
        == {
            reqs[0].request_id: MIN_JUDGED,
            reqs[1].request_id: MIN_JUDGED + 8,
        }
    ), seen
    assert sorted(live for _, live in seen["released"].values()) == [0, 1], seen
    assert not guard.tracking and "wave_guard" in policy.summary()


def test_the_trained_pairs_c8_and_c16_cells_after_c1_hold_plain():
    # the bench's order with c1 first: H200 runs 154 / 157 read c8 0.887 / 0.905 of plain (the c8 cell speculated
    # on the c1 cell's rates, then probed every wave); replayed, 0.857 / 0.974 at c8 / c16 before the guard. With
    # it the c8 cell's first round loses and the next FIRST_HOLD are held, as are the c16 cell's but a re-test
    got = replay_bench([1, 8, 16])
    for c in (8, 16):
        rows = got[c]
        adaptive = median([r[0] for r in rows])
        assert adaptive >= 0.99, f"c{c} after c1: adaptive {adaptive:.3f} of plain, rounds {[r[0] for r in rows]}"
    c1 = median([r[0] for r in got[1]])
    assert c1 > 2.5, f"c1: adaptive {c1:.3f} of plain"
