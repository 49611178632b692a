"""The prefix cache in the server's usage: with `--enable-prefix-caching` every answer's usage carries
OpenAI's `prompt_tokens_details.cached_tokens` (0 when nothing was cached; a repeated prompt then reads its
whole blocks from the cache: a multiple of the page size, below prompt_tokens), for completions, chat and the
streamed usage chunk, a prompt of n choices counting once; without the cache the field is absent. The
trained tiny pair (target + DFlash drafter), CPU fp32, served in-process, driven by the `openai` client.

Run: python -m pytest -q tests/serve/test_prefix_usage.py
"""

from __future__ import annotations

import pytest

from refengine.server.serve import BackgroundServer
from tests.adapter import cpu_engine
from tests.serve.conftest import PAIR, require

PROMPT = "def fibonacci(n):\n    # the n-th Fibonacci number, iteratively, with a docstring and a test\n" * 3
MSGS = [{"role": "user", "content": PROMPT}]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def caching_server():
    engine = cpu_engine(PAIR / "target", PAIR / "draft", enable_prefix_caching=True)
    srv = BackgroundServer(engine, model_name="tiny-trained")
    yield srv
    srv.stop()


def client(srv):
    return require("openai").OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def cached_of(usage) -> int:
    details = usage.prompt_tokens_details
    assert details is not None, f"usage without prompt_tokens_details: {usage}"
    return details.cached_tokens


def test_repeated_prompts_report_their_cached_tokens(caching_server):
    c, page = client(caching_server), caching_server.loop.engine.pool.page_size
    kw = {"model": "tiny-trained", "prompt": PROMPT, "max_tokens": 4}
    first = c.completions.create(**kw).usage
    again = c.completions.create(**kw).usage
    assert cached_of(first) == 0, f"a cold cache reported {first}"
    hit = cached_of(again)
    assert 0 < hit < again.prompt_tokens and hit % page == 0, f"repeat: {again} (page {page})"
    both = c.completions.create(**kw, n=2).usage  # one prompt, two choices: the prompt counts once
    assert cached_of(both) == hit and both.prompt_tokens == again.prompt_tokens, f"n=2: {both} vs {again}"
    chat = {"model": "tiny-trained", "messages": MSGS, "max_tokens": 4}
    c.chat.completions.create(**chat)
    warm = c.chat.completions.create(**chat).usage
    assert 0 < cached_of(warm) < warm.prompt_tokens, f"chat repeat: {warm}"
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = next(ch.usage for ch in chunks if ch.usage is not None)
    assert cached_of(streamed) == hit, f"streamed usage {streamed}, non-streamed {again}"


def test_without_the_cache_usage_has_no_details(spec_server):
    usage = client(spec_server).completions.create(model="tiny-trained", prompt=PROMPT, max_tokens=2).usage
    assert usage.prompt_tokens_details is None, f"no prefix cache, yet {usage}"
