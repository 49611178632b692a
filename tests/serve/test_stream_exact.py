"""Streaming carries exactly what the non-streamed answer holds (issue 51, item 3): every kept token once, with
its logprobs and a text offset into the whole completion, for stop strings, stop tokens, min_tokens and
multi-byte characters.

Unit level (TextState, no server): random token sequences of the tiny tokenizer (multi-byte characters split
across tokens among them) with random stop strings and stop ids, fed in random groupings, give the same
text, kept tokens and offsets as one-shot feeding, the pieces of `take` concatenate to them, and the text is
the decode of the kept tokens cut at the stop. Server level: for many random prompts (emoji and other
multi-byte text included), streamed completions and chat equal the non-streamed ones in text, tokens,
token_logprobs, top_logprobs, text_offset and finish_reason. CPU, fp32, the trained tiny pair.

Run: python -m pytest -q tests/serve/test_stream_exact.py
"""

from __future__ import annotations

import json
import random
import threading
import urllib.request

from refengine.server.text import TextState
from tests.serve.conftest import call

EMOJI = "emoji: \U0001f600"


def feed(detok, ids, stops, stop_ids, min_tokens, groups):
    """Feed ids in the given group sizes; returns (pieces, token ranges, state)."""
    st = TextState(detok, stops, frozenset(stop_ids), min_tokens)
    pieces, ranges, i = [], [], 0
    for g in groups:
        st.add(ids[i : i + g])
        i += g
        final = st.stopped or i >= len(ids)
        piece, lo, hi = st.take(final)
        pieces.append(piece)
        ranges.append((lo, hi))
        if final:
            break
    return pieces, ranges, st


def random_groups(rng, n):
    out = []
    while sum(out) < n:
        out.append(rng.randint(1, 5))
    return out


def test_text_state_grouping_independent(detok):
    rng = random.Random(51)
    samples = [EMOJI * 3, "naïve café — 日本語のテキスト ✓", "def f(x):\n    return x  # ok\n", "😀😁😂 a b c"]
    base = [detok.encode(s) for s in samples]
    checked_multibyte = 0
    for trial in range(150):
        ids = list(rng.choice(base))
        ids += [rng.randrange(4096) for _ in range(rng.randint(0, 12))]
        rng.shuffle(ids) if trial % 3 == 0 else None
        text = detok.decode(ids)
        stops = [text[j : j + rng.randint(1, 4)] for j in sorted(rng.sample(range(len(text)), min(2, len(text))))]
        stops = [s for s in stops if s and rng.random() < 0.7]
        stop_ids = [rng.choice(ids)] if rng.random() < 0.3 else []
        min_tokens = rng.choice([0, 0, 2, 5])
        one = feed(detok, ids, stops, stop_ids, min_tokens, [len(ids)])[2]
        for _ in range(3):
            pieces, ranges, st = feed(detok, ids, stops, stop_ids, min_tokens, random_groups(rng, len(ids)))
            assert "".join(pieces) == st.text == one.text, (ids, stops, pieces, one.text)
            assert st.kept_ids == one.kept_ids, (ids, stops, stop_ids, st.kept_ids, one.kept_ids)
            assert [r for lo, hi in ranges for r in range(lo, hi)] == list(range(len(st.kept_ids))), ranges
            assert st.offsets(0, len(st.kept_ids)) == one.offsets(0, len(one.kept_ids))
        kept = one.kept_ids
        full = detok.decode(kept)
        assert full.startswith(one.text), (kept, full, one.text)
        if not one.stopped:
            assert one.text == detok.decode(ids), (ids, one.text)
        checked_multibyte += any(ord(c) > 0xFFFF for c in one.text)
    assert checked_multibyte > 10, f"only {checked_multibyte} trials held a 4-byte character"


TOL = 1e-4  # fp32 logprobs of the same tokens differ by batch composition (concurrent requests) at ~1e-6


def close(got, want, where):
    assert len(got) == len(want), f"{where}: {len(got)} values != {len(want)}"
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    assert worst <= TOL, f"{where}: logprobs differ by up to {worst:.2e} (> {TOL}): {got} != {want}"


def sse_events(srv, path, body):
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.strip()
            if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                out.append(json.loads(line[6:]))
    return out


def merged_completion(events):
    """Streamed completion chunks -> (text, logprobs merged, finish_reason)."""
    text, lp, finish = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
    for ev in events:
        assert "error" not in ev, ev
        for ch in ev["choices"]:
            text += ch["text"]
            for k in lp:
                lp[k] += (ch["logprobs"] or {}).get(k, [])
            finish = ch["finish_reason"] or finish
    return text, lp, finish


def random_cases(rng, n):
    words = ["def", "return", "x", "😀", "é", "日本", "  ", "\n", "class", "(", ")", ":", "🎉", "ß", "for i in"]
    cases = [{"prompt": EMOJI, "max_tokens": 24, "logprobs": 1}]
    for _ in range(n - 1):
        prompt = "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(1, 8)))
        cases.append({"prompt": prompt, "max_tokens": rng.randint(4, 24), "logprobs": rng.randint(0, 3)})
    return cases


def test_stream_equals_non_stream(spec_server):
    rng = random.Random(7)
    cases = random_cases(rng, 14)
    results: list = [None] * len(cases)

    def run(i):
        body = cases[i]
        st, plain, _ = call(spec_server, "POST", "/v1/completions", body)
        assert st == 200, plain
        text = plain["choices"][0]["text"]
        stop = []
        if len(text) > 3 and i % 2:  # a stop string from the middle of the answer
            j = rng.randrange(1, len(text) - 1)
            stop = [text[j : j + rng.randint(1, 3)]]
            st, plain, _ = call(spec_server, "POST", "/v1/completions", {**body, "stop": stop})
            assert st == 200, plain
        events = sse_events(spec_server, "/v1/completions", {**body, "stop": stop, "stream": True})
        results[i] = (plain, merged_completion(events), stop)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for body, (plain, (text, lp, finish), stop) in zip(cases, results):
        want = plain["choices"][0]
        where = f"{body} stop={stop!r}"
        assert text == want["text"], f"{where}: streamed {text!r} != {want['text']!r}"
        assert finish == want["finish_reason"], where
        if body["logprobs"] is None:
            continue
        w = want["logprobs"]
        for k in ("tokens", "text_offset"):
            assert lp[k] == w[k], f"{where}: {k} streamed {lp[k]} != {w[k]}"
        close(lp["token_logprobs"], w["token_logprobs"], where)
        assert [list(d) for d in lp["top_logprobs"]] == [list(d) for d in w["top_logprobs"]], where
        close(
            [v for d in lp["top_logprobs"] for v in d.values()],
            [v for d in w["top_logprobs"] for v in d.values()],
            where,
        )
        assert len(lp["tokens"]) == plain["usage"]["completion_tokens"], where
    n_stopped = sum(1 for _, (_, _, f), stop in results if stop and f == "stop")
    assert n_stopped >= 4, f"only {n_stopped} cases ended at a stop string"
    emoji_plain = results[0][0]
    assert len(results[0][1][1]["tokens"]) == emoji_plain["usage"]["completion_tokens"] == 24


def test_chat_stream_logprobs_equal(spec_server):
    msgs = [{"role": "user", "content": "Write 😀 and café twice."}]
    body = {"messages": msgs, "max_tokens": 16, "logprobs": True, "top_logprobs": 2, "stop": ["\n\n"]}
    st, plain, _ = call(spec_server, "POST", "/v1/chat/completions", body)
    assert st == 200, plain
    events = sse_events(spec_server, "/v1/chat/completions", {**body, "stream": True})
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    lps = [
        x
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for x in e["choices"][0]["logprobs"]["content"]
    ]
    assert content == plain["choices"][0]["message"]["content"]
    assert lps == plain["choices"][0]["logprobs"]["content"], (
        len(lps),
        len(plain["choices"][0]["logprobs"]["content"]),
    )
    assert len(lps) == plain["usage"]["completion_tokens"]
