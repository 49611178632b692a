"""The draft-to-verify hand-off on the device (refengine/runner/draft_handoff.py): with a draft graph, a verify
step's drafts go from the draft graph's argmax straight into the verify graph's token ids, and the host reads
them once, after the verify. Checks: the placeholders in the host's layout become each request's drafts on
the device, wherever the layout put them; the graph modes on the CPU (fake capturer) take the hand-off and
produce the same drafts, committed lengths and outputs as the host path (drafts read back before the
verify); a proposer whose `propose` was replaced goes the host way; the clock's split adds up to the step.

Run: pytest tests/unit/test_draft_handoff.py        (on CUDA: tests/gpu/test_gpu_draft_handoff.py)
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from refengine import SamplingParams
from refengine.runner import verify_step
from refengine.runner.draft_handoff import VerifyClock, draft_fill, launch_drafts, placeholders
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts
from tests.adapter import assert_same_tokens, cpu_engine, greedy

PROMPTS = [[5, 7, 9], [11, 12, 13, 14, 15], [3, 4], [21, 22, 23, 24]]
BUDGETS = [40, 23, 31, 17]  # budgets ending mid-block: verify steps mix full and truncated spans


def test_placeholders_become_each_requests_drafts_wherever_the_layout_put_them():
    width = 15
    tokens = torch.arange(100, 100 + 4 * width)  # the draft graph's argmax: item j's drafts at [j*15, j*15+14]
    launched = LaunchedDrafts(tokens, [3, 5], width)
    assert placeholders(launched, 0) == [-1, -2] and placeholders(launched, 1) == [-16, -17, -18, -19]
    # a verify layout: request 0 (span 3), a span-1 request, request 1 (span 5), a padding row, the rest zero
    rows = [7, *placeholders(launched, 0), 8, 9, *placeholders(launched, 1), 0, 0, 0]
    ids = torch.tensor(rows)
    draft_fill(launched)(SimpleNamespace(ids=ids))
    want = [7, 100, 101, 8, 9, 115, 116, 117, 118, 0, 0, 0]
    assert ids.tolist() == want, f"verify ids {ids.tolist()}, want {want}"
    assert launched.read() == [[100, 101], [115, 116, 117, 118]]


def run_handoff(engine, host: bool, monkeypatch):
    """Run PROMPTS / BUDGETS to the end, the host path when `host`: (outputs, committed lengths per request,
    each verify step's drafts as the commit saw them, the runner's launches that stayed on the device).
    Shared with tests/gpu/test_gpu_draft_handoff.py."""
    launches = [0]  # the runner's launches whose drafts stayed on the device

    def counted(proposer, items, _orig=verify_step.launch_drafts):
        out = _orig(proposer, items)
        launches[0] += out is not None
        return out

    monkeypatch.setattr(verify_step, "launch_drafts", counted)
    if host:
        engine.proposer.propose = engine.proposer.propose  # replaced on the instance: the host path
    commits: list[tuple[tuple[int, ...], ...]] = []  # each verify step's drafts, as the commit saw them

    def logged(plan, result, _orig=engine.scheduler.commit):
        if result.drafts:
            commits.append(tuple(tuple(d) for d in result.drafts))
        return _orig(plan, result)

    engine.scheduler.commit = logged
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(PROMPTS, BUDGETS)]
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    stats = [r.spec.committed_per_step for r in reqs]
    return [r.output_ids for r in reqs], stats, commits, launches[0]


def assert_steps_equal(stats, commits, h_stats, h_commits) -> None:
    """The hand-off's committed lengths per request and drafts per verify step equal the host path's (with fixed
    spans both run the same graphs on the same inputs). Shared with tests/gpu/test_gpu_draft_handoff.py."""
    first = next((i for i, (a, b) in enumerate(zip(stats, h_stats)) if a != b), None)
    assert first is None, f"request {first}: committed per step {stats[first]} (hand-off) != {h_stats[first]} (host)"
    step = next((i for i, (a, b) in enumerate(zip(commits, h_commits)) if a != b), None)
    assert step is None and len(commits) == len(h_commits), (
        f"verify step {step} of {len(commits)} / {len(h_commits)}: drafts differ between hand-off and host path"
    )


def _run(pair, mode: str, speculation: str, host: bool, monkeypatch):
    engine = cpu_engine(pair.target, pair.draft, graph_mode=mode, max_num_seqs=4, speculation=speculation)
    return run_handoff(engine, host, monkeypatch)


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_handoff_equals_the_host_path(trained_pair, mode, speculation, monkeypatch):
    """The hand-off ran, and the outputs are greedy's. With fixed spans, every verify step's drafts and every
    request's committed lengths equal the host path's too (adaptive spans follow measured step times, so
    two adaptive runs may choose differently)."""
    want = greedy(cpu_engine(trained_pair.target), PROMPTS, BUDGETS)
    out, stats, commits, launches = _run(trained_pair, mode, speculation, False, monkeypatch)
    h_out, h_stats, h_commits, h_launches = _run(trained_pair, mode, speculation, True, monkeypatch)
    assert launches > 0 and h_launches == 0, f"hand-off launches {launches}, host path {h_launches}"
    for i, (o, h, w) in enumerate(zip(out, h_out, want)):
        assert_same_tokens(o, w, f"request {i}, hand-off")
        assert_same_tokens(h, w, f"request {i}, host path")
    if speculation != "fixed":
        return
    assert_steps_equal(stats, commits, h_stats, h_commits)
    assert sum(sum(s) for s in stats) > sum(len(s) for s in stats), "the trained pair accepted no draft at all"


def test_replaced_propose_and_eager_mode_take_the_host_path(trained_pair):
    engine = cpu_engine(trained_pair.target, trained_pair.draft, graph_mode="eager", max_num_seqs=4)
    items = [DraftItem(0, 5, 3, 4)]
    assert launch_drafts(engine.proposer, items) is None  # no draft graph: nothing ran
    engine = cpu_engine(trained_pair.target, trained_pair.draft, graph_mode="full", max_num_seqs=4)
    engine.proposer.propose = engine.proposer.propose
    assert launch_drafts(engine.proposer, items) is None


def test_clock_split_adds_up_to_the_step():
    clock = VerifyClock(torch.device("cpu"))
    sum(range(10000))
    clock.drafted()
    sum(range(10000))
    draft, verify = clock.split()
    assert 0 < draft and 0 < verify
    assert draft + verify == pytest.approx(time.perf_counter() - clock.t0, abs=5e-3)
