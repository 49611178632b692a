"""`golden conform` against real and faulty servers: it passes on `refengine serve` (spec on, with the
spec-off server as --baseline-url, and spec off alone) and each check fails exactly on its own fault.

The servers run the trained tiny pair on CPU (fp32, eager) in-process (refengine.server.serve.BackgroundServer);
an unknown server (empty /metrics, no logprobs on echo) skips topk and acceptance saying why and passes the
rest; --pair as the checkpoint computes the goldens live. The faulty ones are tests/conform/faulty.py
proxies: in front of the spec server, a token flipped in one answer fails `greedy` only, stale scoring
answers for a re-used prompt fail `topk` only, concurrent answers that differ from solo fail `concurrency`
only, a halved accepted-length counter fails `acceptance` only; in front of the spec-off server, one flipped
answer fails `baseline` only. Each run gates 3 golden prompts (--prompts 3) with the fp32 tolerances and
leaves out the `sampling` check (about 50 s a run: tests/golden/test_conform_sampling.py has it), except
the unknown server's, which skips it (no token_ids). This file bridges engine and golden; golden itself
never imports refengine.

Run: PYTHONPATH=. python -m pytest tests/golden/test_conform_servers.py -q -p no:cacheprovider
"""

from __future__ import annotations

import io
import json

from conftest import FIXTURES
from golden.cli import main
from golden.conform.parse import TokenMap
from tests.conform.faulty import (
    ConcurrentDiffers,
    Fault,
    FaultyProxy,
    FlipOneToken,
    HalfAcceptance,
    StaleLogprobs,
    UnknownNoEcho,
)

PAIR = FIXTURES / "tiny-trained"
GOLDEN = FIXTURES.parent / "golden" / "data" / "tiny-trained"
CHECKS = ("topk", "greedy", "concurrency", "baseline", "acceptance")  # `sampling` runs where asked for


def conform(url: str, *extra: str) -> tuple[int, dict, str]:
    out = io.StringIO()
    argv = ["conform", "--url", url, "--model", "tiny-trained", "--pair", str(GOLDEN), "--tol", "fp32"]
    checks = [] if "--checks" in extra else ["--checks", ",".join(CHECKS)]
    code = main([*argv, "--prompts", "3", *checks, *extra], out)
    text = out.getvalue()
    return code, json.loads(text.strip().splitlines()[-1]), text


def statuses(result: dict) -> dict[str, str]:
    return {name: c["status"] for name, c in result["checks"].items()}


def url_of(srv) -> str:
    return f"http://{srv.host}:{srv.port}"


def test_real_server_spec_on_with_baseline_passes(spec_server, plain_server):
    code, result, text = conform(url_of(spec_server), "--baseline-url", url_of(plain_server))
    assert code == 0, text
    st = statuses(result)
    assert st == dict.fromkeys(CHECKS, "pass"), text
    acc = result["checks"]["acceptance"]
    assert acc["verify_steps"] > 0 and abs(acc["delta"]) < 1e-9, text  # fp32 CPU: tau equals the golden's


def test_real_server_spec_off_passes_and_says_why_acceptance_is_skipped(plain_server):
    code, result, text = conform(url_of(plain_server))
    assert code == 0, text
    st = statuses(result)
    assert st == {**dict.fromkeys(("topk", "greedy", "concurrency"), "pass"), **dict.fromkeys(CHECKS[3:], "skip")}
    assert "not speculating" in result["checks"]["acceptance"]["summary"], text
    assert "no --baseline-url" in result["checks"]["baseline"]["summary"], text


def run_faulty(spec_server, fault: Fault, *extra: str) -> tuple[int, dict[str, str], str]:
    proxy = FaultyProxy((spec_server.host, spec_server.port), fault)
    try:
        code, result, text = conform(proxy.url, *extra)
    finally:
        proxy.stop()
    return code, statuses(result), text


def expected(failing: str) -> dict[str, str]:
    return {
        **dict.fromkeys(("topk", "greedy", "concurrency", "acceptance"), "pass"),
        "baseline": "skip",
        failing: "fail",
    }


def test_flipped_token_fails_greedy_only(spec_server):
    tmap = TokenMap.from_tokenizer(PAIR / "target" / "tokenizer.json")
    # an unambiguous word-like token string: its id is read back exactly, and greedy text rarely picks it
    replacement = next(s for s, ids in tmap.by_string.items() if len(ids) == 1 and len(s) > 3 and s.isalpha())
    fault = FlipOneToken(nth=2, replacement=replacement)
    code, st, text = run_faulty(spec_server, fault)
    assert fault.flipped == 1
    assert code == 1 and st == expected("greedy"), text
    assert "first divergence 2" in text and "violation:" in text, text  # the numbers are printed


def test_stale_logprobs_for_a_reused_prompt_fail_topk_only(spec_server):
    fault = StaleLogprobs()
    code, st, text = run_faulty(spec_server, fault)
    assert fault.hits >= 1
    assert code == 1 and st == expected("topk"), text
    assert "/reused pos" in text, text  # the violations name the re-used sequences and positions


def test_concurrent_outputs_differing_from_solo_fail_concurrency_only(spec_server):
    fault = ConcurrentDiffers(junk="\u2603\u2603 snowman")
    code, st, text = run_faulty(spec_server, fault)
    assert fault.changed >= 1
    assert code == 1 and st == expected("concurrency"), text
    assert "/burst" in text and "regret" in text, text


def test_half_acceptance_counter_fails_acceptance_only(spec_server):
    code, st, text = run_faulty(spec_server, HalfAcceptance())
    assert code == 1 and st == expected("acceptance"), text
    assert "relative delta -0.5000" in text, text


def test_unknown_server_skips_what_its_answers_cannot_support_and_says_why(spec_server):
    code, st, text = run_faulty(spec_server, UnknownNoEcho(), "--checks", ",".join([*CHECKS, "sampling"]))
    assert code == 0, text
    assert st == {
        **dict.fromkeys(("greedy", "concurrency"), "pass"),
        **dict.fromkeys(("topk", "baseline", "acceptance", "sampling"), "skip"),
    }, text
    assert "unknown server" in text and "do not support this check" in text, text
    assert "support `echo` with `logprobs`" in text, text
    assert "no choices[0].token_ids" in text and "return_token_ids" in text, text


def test_baseline_that_differs_from_spec_fails_baseline_only(spec_server, plain_server):
    tmap = TokenMap.from_tokenizer(PAIR / "target" / "tokenizer.json")
    word = next(s for s, ids in tmap.by_string.items() if len(ids) == 1 and len(s) > 3 and s.isalpha())
    fault = FlipOneToken(nth=1, replacement=word)
    proxy = FaultyProxy((plain_server.host, plain_server.port), fault)  # the spec-off server answers wrongly once
    try:
        code, result, text = conform(url_of(spec_server), "--baseline-url", proxy.url)
    finally:
        proxy.stop()
    assert fault.flipped == 1
    assert code == 1 and statuses(result) == {**expected("baseline"), "baseline": "fail"}, text
    assert "regret gate" in text and "first divergence" in text, text


def test_live_goldens_from_the_checkpoint(spec_server):
    """--pair as the HF checkpoint: the goldens are computed live with HF over the pair's prompt set."""
    out = io.StringIO()
    argv = ["conform", "--url", url_of(spec_server), "--model", "tiny-trained", "--pair", str(PAIR / "target")]
    code = main([*argv, "--tol", "fp32", "--prompts", "2", "--checks", "topk,greedy,acceptance"], out)
    text = out.getvalue()
    result = json.loads(text.strip().splitlines()[-1])
    assert code == 0, text
    assert statuses(result) == {"topk": "pass", "greedy": "pass", "acceptance": "report"}, text
    assert "no acceptance golden" in result["checks"]["acceptance"]["summary"], text
