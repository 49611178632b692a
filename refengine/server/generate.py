"""Choices' generations as the HTTP handlers see them: each choice's Updates from the engine loop through its
TextState, to the end (non-streaming, one choice per run_one) or as SSE chunks (streaming, a prompt's choices
interleaved in one response). Both paths take the same TextState pieces, so a stream carries exactly the
non-streamed text, tokens and logprobs (with their offsets)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from refengine.request import FinishReason
from refengine.runner.logits import TopK
from refengine.server.checks import Prepared
from refengine.server.loop import EngineLoop, Stream, Update
from refengine.server.protocol import ApiError, internal_error
from refengine.server.text import Detok, TextState

POLL_S = 0.5  # how often a waiting handler checks whether its client is still there
FINISH = {FinishReason.EOS: "stop", FinishReason.LENGTH: "length"}

# chunk(choice index, piece, token ids, top-k rows, offsets, finish) -> one SSE event body
Chunk = Callable[[int, str, list[int], list[TopK], list[int], "str | None"], dict]


class ClientGone(Exception):
    pass


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def caching(loop: EngineLoop) -> bool:
    """Whether the engine has a prefix cache (then usage reports prompt_tokens_details.cached_tokens)."""
    return bool(loop.engine.config.enable_prefix_caching)


def usage(p: int, c: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached` (the prefix cache is on): prompt tokens read from it, in prompt_tokens_details."""
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass
class Choice:
    """One generation's state: the TextState, every token's top-k row, and its finish reason once over."""

    state: TextState
    rows: list[TopK] = field(default_factory=list)
    finish: str | None = None
    cached_tokens: int = 0  # of its prompt, from the prefix cache

    def feed(self, upd: Update) -> None:
        self.cached_tokens = upd.cached_tokens
        self.state.add(upd.token_ids)
        self.rows += upd.topk
        if self.state.stopped:
            self.finish = "stop"
        elif upd.finish_reason is not None:
            self.finish = FINISH.get(upd.finish_reason, "abort")


def new_choice(detok: Detok, prep: Prepared) -> Choice:
    return Choice(TextState(detok, prep.stops, prep.stop_ids, prep.min_tokens))


async def updates(stream: Stream, http: Request) -> AsyncIterator[Update]:
    """The stream's Updates until its final one; raises its ApiError, or ClientGone (checked every POLL_S
    whether or not tokens are flowing)."""
    checked = time.monotonic()
    while True:
        try:
            upd = await asyncio.wait_for(stream.queue.get(), POLL_S)
        except asyncio.TimeoutError:
            upd = None
        if time.monotonic() - checked >= POLL_S:
            checked = time.monotonic()
            if await http.is_disconnected():
                raise ClientGone()
        if upd is None:
            continue
        if upd.error is not None:
            raise upd.error
        yield upd
        if upd.final:
            return


async def run_one(loop: EngineLoop, detok: Detok, stream: Stream, prep: Prepared, http: Request) -> Choice:
    """Generate one submitted choice to the end."""
    choice = new_choice(detok, prep)
    try:
        async for upd in updates(stream, http):
            choice.feed(upd)
            if choice.finish is not None:
                break
    finally:
        if choice.finish is None or choice.state.stopped:
            loop.abort(stream, "stop reached" if choice.state.stopped else "client disconnected")
    choice.state.take(final=True)
    return choice


async def first_update(loop: EngineLoop, stream: Stream, http: Request) -> Update:
    """The first Update, before the 200 is sent (so a rejection is still an HTTP error)."""
    try:
        async for upd in updates(stream, http):
            return upd
    except BaseException:
        loop.abort(stream, "client disconnected")
        raise
    raise internal_error("the engine loop ended the request without an update")


async def first_updates(loop: EngineLoop, streams: list[Stream], http: Request) -> list[Update]:
    """Every choice's first Update, before the 200 is sent; when one fails, all are aborted."""
    firsts = []
    try:
        for stream in streams:  # they run together in the engine; awaiting them in turn costs nothing
            firsts.append(await first_update(loop, stream, http))
    except BaseException:
        for stream in streams:
            loop.abort(stream, "another choice of the request failed")
        raise
    return firsts


def stream_response(
    loop: EngineLoop,
    detok: Detok,
    streams: list[Stream],
    firsts: list[Update],
    prep: Prepared,
    http: Request,
    chunk: Chunk,
    usage_chunk: Callable[[dict], dict],
    base_offset: int = 0,
) -> StreamingResponse:
    """SSE of one prompt's choices, choice i's events (index i) sent as its updates arrive: one event per update
    that has text or tokens to send (every kept token exactly once, with its top-k row and text offset), the
    finish reason on each choice's last; the usage chunk (all choices) when asked; `data: [DONE]`."""

    async def gen() -> AsyncIterator[str]:
        choices = [new_choice(detok, prep) for _ in streams]
        merged: asyncio.Queue[tuple[int, Update | Exception]] = asyncio.Queue()

        async def pump(i: int) -> None:  # choice i's updates after its first, into `merged`
            try:
                async for upd in updates(streams[i], http):
                    merged.put_nowait((i, upd))
            except Exception as e:  # noqa: BLE001 - raised by gen, which reads `merged`
                merged.put_nowait((i, e))

        for i, first in enumerate(firsts):
            merged.put_nowait((i, first))
        pumps = [asyncio.ensure_future(pump(i)) for i, first in enumerate(firsts) if not first.final]
        left = len(choices)
        try:
            while left:
                i, upd = await merged.get()
                c = choices[i]
                if isinstance(upd, Exception):
                    raise upd
                if c.finish is not None:
                    continue  # what a stopped choice's stream sent before its abort landed
                c.feed(upd)
                st = c.state
                piece, lo, hi = st.take(final=c.finish is not None)
                if piece or hi > lo or c.finish is not None:
                    rows = c.rows[lo:hi] if prep.n_logprobs is not None else []
                    yield sse(chunk(i, piece, st.ids[lo:hi], rows, st.offsets(lo, hi, base_offset), c.finish))
                if c.finish is not None:
                    left -= 1
                    if st.stopped:
                        loop.abort(streams[i], "stop reached")  # its KV is freed while the others run on
            if prep.include_usage:
                n_gen = sum(len(c.state.kept_ids) for c in choices)
                cached = choices[0].cached_tokens if caching(loop) else None  # the prompt counts once, as choice 0's
                yield sse(usage_chunk(usage(len(streams[0].prompt_ids), n_gen, cached)))
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        except ClientGone:
            return  # the unfinished choices are aborted below
        finally:
            for p in pumps:
                p.cancel()
            for stream, c in zip(streams, choices):
                if c.finish is None:
                    loop.abort(stream, "client disconnected")

    return StreamingResponse(gen(), media_type="text/event-stream")
