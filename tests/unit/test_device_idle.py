"""`refengine.bench_steps.device_idle`: the device's idle time read from a profile's kernel and copy intervals
(issue target: GPU idle between steps). Overlapping and nested intervals count once, gaps between them are idle,
the window runs from the first start to the last end; per step and widest gap in ms, and the busy share.

Run: python -m pytest tests/unit/test_device_idle.py -q
"""

from __future__ import annotations

import pytest

from refengine.bench_steps import device_idle


def test_gaps_between_kernels_are_idle_and_overlaps_count_once():
    # us: [0, 100] with [50, 80] nested and [90, 150] overlapping, a 50 us gap, [200, 300], a 400 us gap, [700, 800]
    intervals = [(200.0, 300.0), (0.0, 100.0), (50.0, 80.0), (90.0, 150.0), (700.0, 800.0)]
    got = device_idle(intervals, steps=2)
    assert got == {"gpu_idle_ms_per_step": pytest.approx(0.225), "gpu_widest_gap_ms": 0.4, "gpu_busy_share": 0.4375}


def test_back_to_back_kernels_leave_no_idle_time():
    got = device_idle([(0.0, 10.0), (10.0, 20.0), (20.0, 35.0)], steps=1)
    assert got == {"gpu_idle_ms_per_step": 0.0, "gpu_widest_gap_ms": 0.0, "gpu_busy_share": 1.0}


def test_no_intervals_is_an_error():
    with pytest.raises(ValueError, match="device intervals"):
        device_idle([], steps=4)
