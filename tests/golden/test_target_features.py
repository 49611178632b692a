"""Direct feature checks, CPU fp32: every target-feature row refengine hands its drafter (read from the
feature store when the lane's append_pending_context / append_pending_step commits it, via
tests/adapter.FeatureRecorder) equals HF's tap-layer outputs for that request's own tokens
(golden.hf_reference.target_features), row by row, within golden.gates.FEATURE_REL_TOL: rows from a prefill
alone, from a batched prefill of several requests, and from verify commits; and from decode steps of
drafting requests at span 1 (one staged step, a row per request).
Every request hands over exactly its committed length of rows. Teeth: a tap layer off by one, a batched
prefill handing each request its neighbour's rows, verify rows shifted by one, and a decode step's rows
rotated between requests each fail the check at the right position and source (all keep outputs lossless;
tau barely notices the first two).

Run: pytest tests/golden/test_target_features.py
"""

from __future__ import annotations

import json
import random

import pytest

from golden import hf_reference
from golden.features import feature_check
from golden.gates import FEATURE_REL_TOL
from golden.pairs import pair_spec, text_prompts
from refengine import SamplingParams
from tests.adapter import (
    FeatureRecorder,
    assert_no_leftovers,
    break_decode_step_rows_rotated,
    break_rotate_batched_prefill_features,
    break_tap_layers_off_by_one,
    break_verify_features_shifted,
    cpu_engine,
    first_divergence,
)
from tests.span_policies import every_third_drafts

BUDGETS = [40, 17, 33, 40, 5, 24, 16]


def _prompts(pair) -> list[list[int]]:
    if pair.has_tokenizer:
        return list(text_prompts(pair_spec(pair.name)).values())[: len(BUDGETS)]
    vocab = json.loads((pair.target / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    return [[rng.randrange(3, vocab - 1) for _ in range(n)] for n in (5, 18, 31, 44, 57, 70, 83)]


def _labels(recorder: FeatureRecorder, req_id: int) -> list[str]:
    out = []
    for _pos, rows, kind, size in sorted(recorder.sources(req_id)):
        out += [f"{kind} of {size}"] * rows
    return out


def feature_reports(pair, *breakages, make_engine=cpu_engine, hf_dtype=None, rel_tol=FEATURE_REL_TOL, **engine_kw):
    """Request 0 is prefilled alone; the other six arrive together (one batched prefill); all then verify
    together. Returns (FeatureReport per request, per-request row labels). The engine comes from
    `make_engine` (the GPU suite passes tests.adapter.gpu_engine, HF then runs in `hf_dtype` on CUDA)."""
    engine = make_engine(pair.target, pair.draft, **engine_kw)
    for breakage in breakages:
        breakage(engine)
    recorder = FeatureRecorder(engine)
    prompts = _prompts(pair)
    reqs = [engine.add_request(prompts[0], SamplingParams(max_tokens=BUDGETS[0], ignore_eos=True))]
    engine.step()
    reqs += [
        engine.add_request(p, SamplingParams(max_tokens=b, ignore_eos=True)) for p, b in zip(prompts[1:], BUDGETS[1:])
    ]
    while engine.has_work():
        engine.step()
    assert_no_leftovers(engine, "feature scenario")
    taps = engine.drafter.cfg.target_layer_ids  # what the drafter was trained on, not what the lane captured
    reports, labels = [], []
    for i, r in enumerate(reqs):
        rows = recorder.rows(r.request_id)
        committed = len(r.prompt_ids) + len(r.output_ids) - 1
        ids = (r.prompt_ids + r.output_ids)[:committed]
        if hf_dtype is None:
            want = hf_reference.target_features(pair.target, ids, taps)
        else:
            want = hf_reference.target_features(pair.target, ids, taps, dtype=hf_dtype, device="cuda").float().cpu()
        labels.append(_labels(recorder, r.request_id))
        reports.append(
            feature_check(
                f"request {i}", rows.float(), want, expected_rows=committed, labels=labels[-1], rel_tol=rel_tol
            )
        )
    return reports, labels


def test_features_handed_to_the_drafter_equal_hf(model_pair):
    reports, labels = feature_reports(model_pair)
    for rep in reports:
        print(rep)
    assert "PrefillPlan of 1" in labels[0] and all("PrefillPlan of 6" in lab for lab in labels[1:])
    assert all(any(x.startswith("VerifyPlan") for x in lab) for lab in labels), "every request verifies"
    for rep in reports:
        rep.assert_passes()


def _two_plain_steps_per_draft(engine) -> None:
    """The span policy replaced: two plain decode steps (every span 1), then a drafting one."""
    engine.span_policy = engine.scheduler.policy = every_third_drafts(engine.proposer.block_size)


def assert_adaptive_reports_pass(reports, labels) -> None:
    """Every request handed over rows of plain decode steps and of verifies, and every row passes."""
    for rep in reports:
        print(rep)
    assert all(any(x.startswith("DecodePlan") for x in lab) for lab in labels), "every request decodes plainly"
    assert all(any(x.startswith("VerifyPlan") for x in lab) for lab in labels), "every request verifies"
    for rep in reports:
        rep.assert_passes()


def test_adaptive_plain_steps_hand_the_drafter_hf_features(model_pair):
    assert_adaptive_reports_pass(*feature_reports(model_pair, _two_plain_steps_per_draft))


def test_feature_check_fails_on_rotated_decode_step_rows(trained_pair):
    reports, labels = feature_reports(trained_pair, _two_plain_steps_per_draft, break_decode_step_rows_rotated)
    for rep in reports:
        print(rep)
    bad = [i for i, rep in enumerate(reports) if not rep.passed]
    assert bad == list(range(7)), f"requests failing the feature check: {bad}, expected all 7"
    prompts = _prompts(trained_pair)
    for i in bad:
        rep = reports[i]
        assert rep.first_bad_label.startswith("DecodePlan"), str(rep)
        assert rep.first_bad_row == len(prompts[i]) and rep.first_bad_rel > 100 * rep.rel_tol, str(rep)


@pytest.mark.parametrize(
    "breakage,failing,first_label",
    [
        (break_tap_layers_off_by_one, range(7), "PrefillPlan"),
        (break_rotate_batched_prefill_features, range(1, 7), "PrefillPlan of 6"),
        (break_verify_features_shifted, range(7), "VerifyPlan"),
    ],
    ids=["tap-layer+1", "neighbour-rows", "verify-rows-shifted"],
)
def test_feature_check_fails_on_a_broken_engine(trained_pair, breakage, failing, first_label):
    reports, _ = feature_reports(trained_pair, breakage)
    for rep in reports:
        print(rep)
    bad = [i for i, rep in enumerate(reports) if not rep.passed]
    assert bad == list(failing), f"requests failing the feature check: {bad}, expected {list(failing)}"
    prompts = _prompts(trained_pair)
    for i in bad:
        rep = reports[i]
        assert rep.first_bad_label.startswith(first_label), str(rep)
        if breakage is break_verify_features_shifted:
            want_pos = len(prompts[i])  # the first verify row (the first generated token's position)
        elif breakage is break_rotate_batched_prefill_features:
            # the neighbour's rows are right where the two prompts agree (the chat prompts share a prefix)
            want_pos = first_divergence(prompts[i], prompts[i + 1 if i < 6 else 1])
        else:
            want_pos = 0
        assert rep.first_bad_row == want_pos and rep.first_bad_rel > 100 * rep.rel_tol, str(rep)
