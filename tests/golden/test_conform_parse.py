"""`golden conform`'s readers on answers in each server's shape, with no server: completions `logprobs`
(refengine / SGLang: {token string: logprob} objects, echo first), vLLM's `token_id:N` strings and
`prompt_logprobs` (exact ids), token strings shared by several ids (U+FFFD), the Prometheus readers
(refengine's histogram, vLLM's counters, SGLang's gauge) and tau over a window, and the text-only regret gate
against a scripted scorer. The samples follow the field names each project documents (see
golden/conform/parse.py and prom.py for the links).

Run: PYTHONPATH=. python -m pytest tests/golden/test_conform_parse.py -q -p no:cacheprovider
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from golden.conform.checks import SKIP, check_acceptance
from golden.conform.parse import ResponseError, TokenMap, generated_ids, scored_sequence
from golden.conform.prom import SpecCounters, parse_samples, server_kind, tau_between
from golden.conform.textgate import text_regret_gate
from golden.records import TopKRecord

# a toy vocabulary: ids 0..4 are words, 5 and 6 both decode to U+FFFD (byte tokens)
TMAP = TokenMap(by_string={"a": [0], " b": [1], " c": [2], "d": [3], " e": [4], "\ufffd": [5, 6]})


def echo_answer(tops: list[dict | None]) -> dict:
    return {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": [], "top_logprobs": tops}}]}


def test_openai_echo_rows_shift_by_one_and_the_generated_row_is_last():
    # ids [0, 1]: entry 0 is None (nothing predicts the first token), entry 1 predicts id 1, entry 2 is generated
    ans = echo_answer([None, {" b": -0.1, " c": -2.5}, {" c": -0.3, "a": -1.5}])
    seq = scored_sequence("s", ans, [0, 1], TMAP)
    assert [r.argmax for r in seq.rows] == [[1], [2]]
    assert seq.rows[0].ids == [1, 2] and seq.rows[0].lps == [-0.1, -2.5]
    assert seq.rows[1].ids == [2, 0]


def test_echo_without_enough_entries_names_what_is_missing():
    with pytest.raises(ResponseError, match="2 top_logprobs entries for a 2-token echoed prompt"):
        scored_sequence("s", echo_answer([None, {" b": -0.1}]), [0, 1], TMAP)


def test_ambiguous_argmax_keeps_its_candidates_and_lower_entries_are_dropped():
    tmap = TokenMap(by_string=dict(TMAP.by_string))
    ans = echo_answer([None, {"\ufffd": -0.2, " b": -0.9}, {" c": -0.1, "\ufffd": -0.5, "d": -3.0}])
    seq = scored_sequence("s", ans, [0, 1], tmap)
    assert seq.rows[0].argmax == [5, 6] and seq.rows[0].ids == [1]
    assert seq.rows[1].argmax == [2] and seq.rows[1].ids == [2, 3]
    assert (tmap.ambiguous, tmap.dropped) == (1, 2)


def test_vllm_token_id_strings_and_prompt_logprobs_give_exact_ids():
    tmap = TokenMap()  # no tokenizer needed
    ans = {
        "choices": [
            {
                "text": "",
                "prompt_logprobs": [
                    None,
                    {
                        "7": {"logprob": -0.4, "rank": 2, "decoded_token": "x"},
                        "9": {"logprob": -0.2, "rank": 1, "decoded_token": "y"},
                    },
                ],
                "logprobs": {"tokens": ["token_id:3"], "top_logprobs": [{"token_id:3": -0.05, "token_id:8": -3.1}]},
            }
        ]
    }
    seq = scored_sequence("v", ans, [4, 7], tmap)
    assert seq.rows[0].ids == [9, 7] and seq.rows[0].argmax == [9]
    assert seq.rows[1].ids == [3, 8]
    assert generated_ids(ans, tmap) == [3]


def test_generated_ids_resolve_ambiguity_by_the_reference_and_reject_unknown_strings():
    tmap = TokenMap(by_string=dict(TMAP.by_string))
    ans = {"choices": [{"text": "", "logprobs": {"tokens": ["a", "\ufffd", " e"], "top_logprobs": []}}]}
    assert generated_ids(ans, tmap, hints=[0, 6, 4]) == [0, 6, 4]
    assert generated_ids(ans, tmap) == [0, 5, 4]  # no hint: the lowest candidate
    with pytest.raises(ResponseError, match="not in the tokenizer's vocabulary"):
        generated_ids({"choices": [{"logprobs": {"tokens": ["zz"]}}]}, tmap)
    with pytest.raises(ResponseError, match="no logprobs.tokens"):
        generated_ids({"choices": [{"text": "a b"}]}, tmap)


def test_tokenizerless_refengine_strings_are_ids():
    assert generated_ids({"choices": [{"logprobs": {"tokens": [" 12", " 7"]}}]}, TokenMap()) == [12, 7]


REFENGINE = """# HELP refengine_spec_accepted_length Committed length (accepted drafts + 1) per verify step.
# TYPE refengine_spec_accepted_length histogram
refengine_spec_accepted_length_bucket{le="1",model="m"} 10.0
refengine_spec_accepted_length_bucket{le="+Inf",model="m"} 13.0
refengine_spec_accepted_length_count{model="m"} 13.0
refengine_spec_accepted_length_sum{model="m"} 19.0
"""
VLLM = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3-4B"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen/Qwen3-4B"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3-4B"} 250.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Qwen/Qwen3-4B"} 150.0
"""
SGLANG = """# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="Qwen/Qwen3-4B"} 3.2
"""


def test_metric_samples_sum_over_labels_and_the_kind_is_read_from_names():
    assert parse_samples(VLLM)["vllm:spec_decode_num_drafts_total"] == 200.0
    assert [server_kind(t) for t in (REFENGINE, VLLM, SGLANG, "up 1\n", None)] == [
        "refengine",
        "vllm",
        "sglang",
        "unknown",
        "unknown",
    ]


def test_tau_over_a_window_for_refengine_and_vllm():
    before = SpecCounters.read(REFENGINE)
    after = SpecCounters.read(REFENGINE.replace("13.0", "23.0").replace("19.0", "39.0"))
    assert tau_between(before, after).tau == pytest.approx(20 / 10)
    v0 = SpecCounters.read(VLLM)
    v1 = SpecCounters.read(
        VLLM.replace("250.0", "330.0").replace(
            '"1",model_name="Qwen/Qwen3-4B"} 100.0', '"1",model_name="Qwen/Qwen3-4B"} 140.0'
        )
    )
    w = tau_between(v0, v1)
    assert (w.steps, w.tau) == (40.0, pytest.approx(1 + 80 / 40))


def test_an_adaptive_servers_window_is_skipped_not_failed():
    """An adaptive server that chose span 1 (plain decode) has tau near 1: not the drafter's, so no verdict. A
    fixed server's span-1 steps (a request's last token) are the drafter's block cut to budget: gated."""
    span, policy = "refengine_spec_span_steps_total", "refengine_spec_span_policy"
    spans = f'{span}{{model="m",span="1"}} %s\n{span}{{model="m",span="8"}} 2.0\n{policy}{{model="m",policy="%s"}} 1\n'
    after_text = REFENGINE.replace("13.0", "23.0").replace("19.0", "35.0")
    w = tau_between(
        SpecCounters.read(REFENGINE + spans % ("5.0", "adaptive")),
        SpecCounters.read(after_text + spans % ("12.0", "adaptive")),
    )
    assert (w.steps, w.plain_steps, w.tau, w.adaptive) == (10.0, 7.0, pytest.approx(1.6), True)
    r = check_acceptance(SimpleNamespace(tau=w), 0.1)  # type: ignore[arg-type]
    assert r.status == SKIP and "7 of 10 verify steps decoded plainly" in r.summary, r.summary
    fixed = tau_between(
        SpecCounters.read(REFENGINE + spans % ("5.0", "fixed")),
        SpecCounters.read(after_text + spans % ("6.0", "fixed")),
    )
    assert (fixed.plain_steps, fixed.adaptive) == (1.0, False)


def test_no_window_says_why():
    s = SpecCounters.read(SGLANG)
    assert "running average 3.2" in tau_between(s, s).reason
    r = SpecCounters.read(REFENGINE)
    assert "not speculating" in tau_between(r, r).reason


def scripted(rows: dict[int, list[tuple[int, float]]]):
    """A score_fn whose row at position p is rows[p] (ids with logprobs, best first)."""

    def score(ids: list[int]) -> TopKRecord:
        n = len(ids)
        got = [rows.get(p, [(0, -0.1), (1, -0.2)]) for p in range(n)]
        return TopKRecord("x", ids, [[t for t, _ in r] for r in got], [[lp for _, lp in r] for r in got])

    return score


def test_text_gate_scores_the_divergence_by_the_least_regret_consistent_candidate():
    # prompt [0], reference output [1, 2] = " b c"; spec text " b d..." diverges at output 1 (row 1)
    near = scripted({1: [(2, -0.50), (3, -0.55), (4, -3.0)]})
    rep = text_regret_gate([0], [1, 2], " b c", " bd", near, TMAP, tol=0.2)
    assert rep.passed and rep.first_divergence == 1 and rep.first_regret == pytest.approx(0.05)
    far = scripted({1: [(2, -0.1), (4, -1.0), (3, -2.0)]})
    rep = text_regret_gate([0], [1, 2], " b c", " bd", far, TMAP, tol=0.2)
    assert not rep.passed and rep.first_regret == pytest.approx(1.9) and "regret 1.9000" in str(rep)
    outside = scripted({1: [(2, -0.1), (4, -1.0)]})  # no top-k candidate spells "d": a lower bound, in_topk False
    rep = text_regret_gate([0], [1, 2], " b c", " bd", outside, TMAP, tol=0.2)
    assert not rep.passed and not rep.violations[0].in_topk
    assert text_regret_gate([0], [1, 2], " b c", " b c", far, TMAP, tol=0.2).first_divergence is None
