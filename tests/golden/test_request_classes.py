"""Request classes no lossless test covers, on the trained pair (real tokenizer and EOS), CPU fp32. Each
check returns its problems as text; each test runs it on the engine (no problems) and on a deliberately
broken copy of the mechanism it guards (problems found), so no check here can silently pass:

- ignore_eos: a prompt whose greedy output hits EOS runs on to max_tokens, equal to HF greedy without EOS
  (spec engine and plain engine); without the flag it stops at EOS.     broken: the flag dropped at submission
- prompt_logprobs: a request asking for prompt logprobs generates exactly what the same request without them
  (and a plain speculating one) generates, in one batched prefill.  broken: first token from the first row
- an ineligible (logprobs) request next to speculating ones advances at least every other step.
                                                                     broken: verify plans always go first
- no drafter context, KV block table or KV reservation outlives its request, checked after every step
  over a mixed scenario (EOS, length, budget 1, rejected, logprobs, staggered).  broken: contexts never released

Run: pytest tests/golden/test_request_classes.py
"""

from __future__ import annotations

import pytest

from golden import hf_reference
from golden.pairs import pair_spec, text_prompts
from refengine import FinishReason, SamplingParams
from refengine.errors import IntegrityError
from tests.adapter import (
    assert_no_leftovers,
    break_drop_ignore_eos,
    break_first_token_from_first_row,
    break_never_release_drafter_context,
    break_starve_plain_requests,
    cpu_engine,
    engine_leftovers,
    first_divergence,
    run_requests,
)

EOS_PROMPT = "chat-explain"  # HF greedy hits EOS after 38 tokens (the trained target's EOS is 0)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts(trained_pair):
    return text_prompts(pair_spec(trained_pair.name))


def _engine(pair, spec: bool, breakage=None, **kw):
    engine = cpu_engine(pair.target, pair.draft if spec else None, **kw)
    if breakage is not None:
        breakage(engine)
    return engine


# ---------------------------------------------------------------- ignore_eos


def ignore_eos_problems(engine, prompt: list[int], want_full: list[int], want_eos: list[int]) -> list[str]:
    problems = []
    reqs = run_requests(
        engine,
        [
            (prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
            (prompt, SamplingParams(max_tokens=MAX_TOKENS)),
        ],
    )
    for r, want, reason, label in (
        (reqs[0], want_full, FinishReason.LENGTH, "ignore_eos=True"),
        (reqs[1], want_eos, FinishReason.EOS, "ignore_eos=False"),
    ):
        d = first_divergence(r.output_ids, want)
        if d is not None or r.finish_reason is not reason:
            problems.append(
                f"{label}: {len(r.output_ids)} tokens, finish {r.finish_reason}, want {len(want)} "
                f"tokens and {reason}; first divergence at {d}: "
                f"got {r.output_ids[d : d + 4] if d is not None else []} "
                f"want {want[d : d + 4] if d is not None else []}"
            )
    assert_no_leftovers(engine, "ignore_eos")
    return problems


@pytest.mark.parametrize("spec", [True, False], ids=["dflash", "plain"])
def test_ignore_eos_runs_past_eos(trained_pair, prompts, spec):
    prompt = prompts[EOS_PROMPT]
    eos = hf_reference._eos_set(pair_spec(trained_pair.name).eos_token_id)
    want_eos = hf_reference.greedy_ids(trained_pair.target, prompt, MAX_TOKENS, list(eos))
    want_full = hf_reference.greedy_ids(trained_pair.target, prompt, MAX_TOKENS, None)
    assert want_eos[-1] in eos and len(want_eos) < MAX_TOKENS == len(want_full), "the prompt must hit EOS"
    assert ignore_eos_problems(_engine(trained_pair, spec), prompt, want_full, want_eos) == []
    broken = ignore_eos_problems(_engine(trained_pair, spec, break_drop_ignore_eos), prompt, want_full, want_eos)
    print("\n".join(broken))
    assert broken and f"ignore_eos=True: {len(want_eos)} tokens, finish FinishReason.EOS" in broken[0]


# ---------------------------------------------------------------- prompt_logprobs


def prompt_logprobs_problems(engine, prompts: dict[str, list[int]]) -> list[str]:
    """Per prompt, three requests in one batched prefill: logprobs + prompt_logprobs, logprobs only, and
    plain (speculating). All three must generate the same tokens."""
    items = []
    for p in prompts.values():
        items += [
            (p, SamplingParams(max_tokens=20, logprobs=4, prompt_logprobs=True)),
            (p, SamplingParams(max_tokens=20, logprobs=4)),
            (p, SamplingParams(max_tokens=20)),
        ]
    reqs = run_requests(engine, items)
    problems = []
    for i, name in enumerate(prompts):
        with_pl, without, plain = reqs[3 * i : 3 * i + 3]
        # one row per prompt position, then one per generated token but the last (nothing scores past it)
        if len(with_pl.topk) != len(with_pl.prompt_ids) + len(with_pl.output_ids) - 1:
            problems.append(
                f"{name}: {len(with_pl.topk)} top-k rows for {len(with_pl.prompt_ids)} prompt + "
                f"{len(with_pl.output_ids)} generated tokens"
            )
        for other, label in ((without, "logprobs only"), (plain, "plain")):
            d = first_divergence(with_pl.output_ids, other.output_ids)
            if d is not None:
                problems.append(
                    f"{name}: prompt_logprobs request differs from the {label} one at generated "
                    f"position {d}: got {with_pl.output_ids[d : d + 4]} want {other.output_ids[d : d + 4]}"
                )
    assert_no_leftovers(engine, "prompt_logprobs")
    return problems


def test_prompt_logprobs_generates_the_same(trained_pair, prompts):
    assert prompt_logprobs_problems(_engine(trained_pair, True), prompts) == []
    broken = prompt_logprobs_problems(_engine(trained_pair, True, break_first_token_from_first_row), prompts)
    print("\n".join(broken))
    assert len(broken) >= len(prompts) and "differs from the logprobs only one at generated position 0" in broken[0]


# ---------------------------------------------------------------- ineligible requests are not starved


def starvation_problems(engine, prompts: list[list[int]]) -> list[str]:
    """4 speculating + 2 ineligible (logprobs) requests submitted together. After the prefill, every
    unfinished ineligible request must grow within every 2 consecutive steps."""
    spec = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts[:4]]
    plain = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)) for p in prompts[4:6]]
    problems, stalled, step = [], {r.request_id: 0 for r in plain}, 0
    while engine.has_work():
        before = {r.request_id: len(r.output_ids) for r in plain}
        engine.step()
        step += 1
        for r in plain:
            if before[r.request_id] == 0 or (r.finished and len(r.output_ids) == before[r.request_id]):
                continue  # not prefilled yet, or done
            stalled[r.request_id] = 0 if len(r.output_ids) > before[r.request_id] else stalled[r.request_id] + 1
            if stalled[r.request_id] == 2:
                live = sum(not s.finished for s in spec)
                problems.append(
                    f"ineligible request {r.request_id} made no progress in steps {step - 1}..{step} "
                    f"({len(r.output_ids)} of 12 tokens) while {live} speculating requests ran"
                )
    assert all(r.spec.verify_steps > 0 for r in spec) and all(len(r.output_ids) == 12 for r in plain)
    assert_no_leftovers(engine, "starvation")
    return problems


def test_ineligible_request_advances_every_other_step(trained_pair, prompts):
    ps = list(prompts.values())
    assert starvation_problems(_engine(trained_pair, True), ps) == []
    broken = starvation_problems(_engine(trained_pair, True, break_starve_plain_requests), ps)
    print("\n".join(broken))
    assert broken and "made no progress in steps 2..3" in broken[0]


# ---------------------------------------------------------------- nothing outlives its request


def leftover_problems(engine, prompts: list[list[int]]) -> list[str]:
    """A mixed scenario; after every step, no finished request may still own a drafter context, a KV block
    table, a KV length or a lifetime reservation; after the last, nothing at all."""
    items = [
        (prompts[6], SamplingParams(max_tokens=MAX_TOKENS)),  # stops at EOS
        (prompts[0], SamplingParams(max_tokens=20, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=1)),
        (prompts[2], SamplingParams(max_tokens=17, logprobs=3, prompt_logprobs=True)),
        (prompts[3], SamplingParams(max_tokens=10_000)),  # rejected: over the context window
        (prompts[4], SamplingParams(max_tokens=16)),
        (prompts[5], SamplingParams(max_tokens=33)),
    ]
    reqs = [engine.add_request(p, sp) for p, sp in items[:4]]
    problems, pending = [], items[4:]
    while engine.has_work() or pending:
        if pending:
            reqs.append(engine.add_request(*pending.pop(0)))
        engine.step()
        done = {r.request_id for r in reqs if r.finished}
        for what, ids in engine_leftovers(engine).items():
            if isinstance(ids, list) and done & set(ids):
                problems.append(f"{what} still held for finished requests {sorted(done & set(ids))}")
    if reqs[0].finish_reason is not FinishReason.EOS or reqs[4].finish_reason is not FinishReason.REJECTED:
        problems.append(f"scenario did not happen: finish reasons {[r.finish_reason for r in reqs]}")
    left = {k: v for k, v in engine_leftovers(engine).items() if v}
    if left:
        problems.append(f"after every request finished: {left}")
    return problems


def test_nothing_outlives_its_request(trained_pair, prompts):
    ps = list(prompts.values())
    assert leftover_problems(_engine(trained_pair, True), ps) == []
    broken = _engine(trained_pair, True, break_never_release_drafter_context)
    # The suite's check after every step (Engine.check_integrity, autouse in conftest) stops the leak at the
    # first step a finished request's drafter context survives; the scenario's own check would report it too.
    with pytest.raises(IntegrityError, match=r"proposer holds requests \[.*\], speculating requests are"):
        leftover_problems(broken, ps)
