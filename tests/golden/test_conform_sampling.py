"""`golden conform`'s `sampling` check against a real and a faulty server: it passes on `refengine serve`
(target + DFlash drafter, the trained tiny pair, CPU fp32, in-process), whose sampled requests speculate
(the server's verify steps grow over the run), and it fails in front of a proxy that forwards every sampled
request at 0.8 times its temperature (tests/conform/faulty.py ColderSampling), with the gate's numbers
printed, while topk, greedy, concurrency and acceptance still pass there (they send temperature 0). The
skip for a server without `token_ids` is in tests/golden/test_conform_servers.py (the unknown server); how
answers are read (token_ids, the echoed prompt) is checked here on hand-made answers.

Each sampling run sends ceil(5119 / 128) = 40 seeded requests of 128 tokens first (ks_sample_size() pooled
positions), then a second round for the answers that ended at EOS: about 50 s a run on 2 CPU cores.

Run: PYTHONPATH=. HF_HUB_OFFLINE=1 python -m pytest tests/golden/test_conform_sampling.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math

import pytest

from golden.conform.parse import ResponseError
from golden.conform.sampling import NoTokenIds, SamplingPlan, sampled_ids
from golden.distribution.stats import ks_sample_size
from tests.conform.faulty import ColderSampling, FaultyProxy
from tests.golden.test_conform_servers import conform, statuses, url_of

pytest.importorskip("transformers")


def test_plan_sends_enough_requests_for_the_gates_power():
    plan = SamplingPlan()
    assert plan.positions == ks_sample_size() == 5119
    assert plan.first_round == math.ceil(5119 / 128) == 40
    body = plan.body([1, 2], seed=7)
    assert body["return_token_ids"] is True and "logprobs" not in body and body["seed"] == 7, body
    assert "top_k" not in body and "ignore_eos" not in body, body  # off: not sent


def test_answers_are_read_by_their_token_ids():
    ok = {"choices": [{"token_ids": [5, 6], "prompt_token_ids": [1, 2], "finish_reason": "stop", "text": "x"}]}
    assert sampled_ids(ok, [1, 2]) == ([5, 6], "stop")
    with pytest.raises(NoTokenIds, match="no choices\\[0\\].token_ids"):
        sampled_ids({"choices": [{"text": "x", "finish_reason": "length"}]}, [1, 2])
    with pytest.raises(ResponseError, match="not the prompt sent"):
        sampled_ids(ok, [1, 3])
    with pytest.raises(ResponseError, match="non-empty list"):
        sampled_ids({"choices": [{"token_ids": []}]}, [1, 2])


def test_sampling_passes_on_the_real_spec_server(spec_server):
    code, result, text = conform(url_of(spec_server), "--checks", "sampling")
    assert code == 0 and statuses(result) == {"sampling": "pass"}, text
    s = result["checks"]["sampling"]
    assert s["positions"] >= s["min_positions"] == ks_sample_size(), text
    assert s["requests"] >= 40 and s["impossible"] == 0, text
    assert s["verify_steps"] > 0, text  # the sampled requests speculated
    assert s["ks_p"] >= 1e-3 and s["chi2_p"] >= 1e-3, text


def test_colder_sampling_fails_sampling_only(spec_server):
    fault = ColderSampling(factor=0.8)
    proxy = FaultyProxy((spec_server.host, spec_server.port), fault)
    try:
        checks = "topk,greedy,concurrency,baseline,acceptance,sampling"
        code, result, text = conform(proxy.url, "--checks", checks)
    finally:
        proxy.stop()
    assert fault.changed >= 40, fault.changed
    st = statuses(result)
    want = {**dict.fromkeys(("topk", "greedy", "concurrency", "acceptance"), "pass"), "baseline": "skip"}
    assert code == 1 and st == {**want, "sampling": "fail"}, text
    s = result["checks"]["sampling"]
    assert s["ks_p"] < 1e-3 and s["positions"] >= ks_sample_size(), text
    assert "distribution gate FAIL" in text and "KS D = " in text, text  # the numbers are printed
