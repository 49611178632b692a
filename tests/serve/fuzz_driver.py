"""The HTTP fuzz client of tests/serve/test_fuzz.py, run in its own process so that hypothesis's own work
does not hold the server's GIL (the server and the /health probe stay in the test process).

hypothesis draws request bodies (the API's own fields with values of every JSON type, lone surrogates, huge and
negative numbers, NaN, deep nesting, raw non-JSON bytes), routes, methods and headers (Content-Type,
Authorization, Host, junk). Every answer must be below 500, carry no traceback or source path, and use the
OpenAI error shape when it is a 4xx; a 200 on a generation route must be well-formed JSON or an SSE stream
ending in [DONE]. Prints {"seen": {status: count}} as its last line; a failing example is hypothesis's
falsifying report on stderr and exit status 1.

Run: python tests/serve/fuzz_driver.py HOST PORT MAX_EXAMPLES
"""

from __future__ import annotations

import http.client
import json
import re
import sys
from collections import Counter
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LEAK = re.compile(r"Traceback|File \"|\.py\b|/work/|site-packages")

text = st.text(st.characters(codec=None, blacklist_categories=()), max_size=24)  # surrogates included
junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8,
)
small = st.integers(-3, 8)
pos = st.integers(1, 8)
huge = st.sampled_from([10**6, 2**63, 10**30, -(10**9)])
not_none = junk.filter(lambda v: v is not None)  # a missing budget means 256 tokens: too slow for a fuzz
tokens = st.lists(st.integers(-2, 5000), min_size=0, max_size=12)
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
prompt = st.one_of(words, words, words, tokens, st.lists(words, max_size=3), st.lists(tokens, max_size=3), junk)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "x"]) | junk},
    optional={"content": text | junk | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}))},
)


def mostly(good, bad=junk):
    return st.one_of(good, good, good, bad)


FIELDS = {
    "model": mostly(st.sampled_from(["tiny-trained", "other"])),
    "max_tokens": mostly(pos, small | huge | not_none),
    "max_completion_tokens": mostly(pos, small | not_none),
    "min_tokens": mostly(small),
    "temperature": mostly(st.sampled_from([0, 0.0, 0.7, 1.0, 2.5])),
    "top_p": mostly(st.floats()),
    "top_k": mostly(st.integers(-2, 50)),
    "n": mostly(st.integers(-1, 3)),  # n x prompts engine requests each: kept small for the per-example deadline
    "stop": mostly(text | st.lists(text, max_size=20)),
    "stop_token_ids": mostly(tokens),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": mostly(st.booleans())})),
    "logprobs": mostly(st.booleans() | small),
    "top_logprobs": mostly(small),
    "echo": mostly(st.booleans()),
    "ignore_eos": mostly(st.booleans()),
    "logit_bias": mostly(st.dictionaries(text, st.floats(), max_size=2)),
    "response_format": mostly(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    "tools": mostly(st.lists(junk, max_size=2)),
    "seed": mostly(st.integers()),
    "tokens": mostly(tokens),
}
extra = st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})
)
completion = st.builds(lambda p, m, x: {"prompt": p, "max_tokens": m, **x}, prompt, pos, extra)
chat = st.builds(lambda ms, m, x: {"messages": ms, "max_tokens": m, **x}, st.lists(message, max_size=3), pos, extra)
raw_body = st.one_of(
    completion.map(lambda o: json.dumps(o).encode()),
    chat.map(lambda o: json.dumps(o).encode()),
    completion.map(lambda o: json.dumps(o).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[" * 5000, b'{"prompt": "\\ud800"}', b"null", b"1e999999"]),
)
ROUTES = [("POST", "/v1/completions")] * 6 + [("POST", "/v1/chat/completions")] * 4
ROUTES += [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models")]
OTHER = [("GET", "/"), ("POST", "/health"), ("POST", "/v1/completions/x"), ("GET", "/../etc/passwd")]
OTHER += [("PUT", "/v1/completions"), ("GET", "/v1/chat/completions"), ("DELETE", "/metrics")]
route = st.one_of(st.sampled_from(ROUTES), st.sampled_from(ROUTES), st.sampled_from(ROUTES), st.sampled_from(OTHER))
request = st.one_of(  # (method, path, body): mostly a body of the route's own kind, else any body anywhere
    completion.map(lambda o: ("POST", "/v1/completions", json.dumps(o).encode())),
    completion.map(lambda o: ("POST", "/v1/completions", json.dumps(o).encode())),
    chat.map(lambda o: ("POST", "/v1/chat/completions", json.dumps(o).encode())),
    st.tuples(route, raw_body).map(lambda rb: (*rb[0], rb[1])),
)
WARMUP = [  # one of each kind first: a first-time code path (lazy imports, new shapes) is not an event-loop stall
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True, "stop": ["a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
]
header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]),
        "Authorization": header_value,
        "Host": mostly(st.sampled_from(["localhost", "127.0.0.1:80", "[::1]", "localhost:1"]), header_value),
        "X-Junk": header_value,
        "Accept-Encoding": st.sampled_from(["gzip", "identity", "*"]),
    },
)


def check_answer(status: int, ctype: str, raw: bytes, where: str) -> None:
    txt = raw.decode("utf-8", "replace")
    assert status < 500, f"{where}: HTTP {status}: {txt[:500]}"
    assert not LEAK.search(txt), f"{where}: HTTP {status} leaks internals: {txt[:500]}"
    if 400 <= status < 500:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], f"{where}: {txt[:300]}"
    elif "event-stream" in ctype:
        events = [x[6:] for x in raw.split(b"\n") if x.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", f"{where}: stream did not end in [DONE]: {txt[-300:]}"
        for ev in events[:-1]:
            json.loads(ev)
    elif status == 200 and ctype.startswith("application/json"):
        json.loads(raw)


DEBUG = False


def run(host: str, port: int, max_examples: int) -> Counter[str]:
    seen: Counter[str] = Counter()

    @settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=5),
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(req=request, headers=headers)
    def one(req, headers):
        method, path, body = req
        c = http.client.HTTPConnection(host, port, timeout=30)
        try:
            c.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
            for k, v in headers.items():
                c.putheader(k, v)
            c.putheader("Content-Length", str(len(body)))
            c.endheaders(body)
            r = c.getresponse()
            seen[f"{r.status} {path}" if r.status == 200 else str(r.status)] += 1
            raw = r.read()
            check_answer(r.status, r.getheader("content-type") or "", raw, f"{method} {path} {body[:200]!r}")
            if r.status == 400 and DEBUG:
                print(json.loads(raw)["error"]["message"][:90], file=sys.stderr)
        finally:
            c.close()

    one()
    return seen


if __name__ == "__main__":
    print(json.dumps({"seen": run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))}))
