"""FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every handler runs on the server's event loop and only talks to the engine through the EngineLoop (commands
in, Updates out). Errors use OpenAI's body {"error": {message, type, param, code}}: 400 for what the engine
cannot honour or rejects (context length, KV budget, bad token ids), 500 for an internal failure (the request
is finished and its KV freed first)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from refengine.errors import RefEngineError
from refengine.request import FinishReason, SamplingParams
from refengine.server.loop import EngineLoop, Stream, Update
from refengine.server.metrics import render_metrics
from refengine.server.protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    prompts_of,
    stop_list,
)
from refengine.server.scoring import prompt_logprobs
from refengine.server.text import Detok, TextState, chat_logprobs, completion_logprobs
from refengine.validation import validate_prompt

POLL_S = 0.5  # how often a waiting handler checks whether its client is still there
FINISH = {FinishReason.EOS: "stop", FinishReason.LENGTH: "length"}


class ClientGone(Exception):
    pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(loop: EngineLoop, detok: Detok, model_name: str, chat_template: str) -> FastAPI:
    import jinja2.sandbox

    app = FastAPI(title="refengine", docs_url=None, redoc_url=None)
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        chat_template
    )
    vocab = loop.engine.target.cfg.vocab_size

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _gone(_req: Request, _e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the request was aborted

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not isinstance(x, int)]
        param = loc[0] if loc else None
        msg = f"{param}: {err.get('msg', 'invalid')}" if param else str(err.get("msg", "invalid request"))
        return JSONResponse(ApiError(400, msg, param).body(), status_code=400)

    def ids_of(prompt: str | list[int]) -> list[int]:
        try:
            ids = detok.encode(prompt) if isinstance(prompt, str) else prompt
            return validate_prompt(ids, vocab)
        except (RefEngineError, ValueError) as e:
            raise ApiError(400, str(e), "prompt") from e

    def params(max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=0 if logprobs is None else max(1, logprobs))
        except RefEngineError as e:
            raise ApiError(400, str(e), "max_tokens") from e

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

    async def run_one(
        ids: list[int], sp: SamplingParams, stops: list[str], http: Request
    ) -> tuple[TextState, list, str]:
        """Generate one choice to the end; returns its text state, top-k rows and finish reason."""
        stream = loop.submit(ids, sp)
        state, rows, finish = TextState(detok, stops), [], None
        try:
            async for upd in updates(stream, http):
                state.add(upd.token_ids)
                rows += upd.topk
                if state.stopped:
                    finish = "stop"
                    break
                if upd.finish_reason is not None:
                    finish = FINISH.get(upd.finish_reason, "abort")
        finally:
            if finish is None or state.stopped:
                loop.abort(stream, "stop string reached" if state.stopped else "client disconnected")
        return state, rows, finish or "abort"

    async def first_update(stream: Stream, http: Request) -> Update:
        try:
            async for upd in updates(stream, http):
                return upd
        except BaseException:
            loop.abort(stream, "client disconnected")
            raise
        raise ApiError(500, "the engine loop ended the request without an update")

    def stream_response(
        stream: Stream, first: Update, stops: list[str], http: Request, chunk, include_usage: bool
    ) -> StreamingResponse:
        """SSE: `chunk(text, upd_ids, rows, finish)` builds one event body; `data: [DONE]` ends it."""

        async def gen() -> AsyncIterator[str]:
            state, done, n_out = TextState(detok, stops), False, 0
            try:
                upd: Update | None = first
                it = updates(stream, http)
                while upd is not None:
                    state.add(upd.token_ids)
                    n_out += len(upd.token_ids)
                    finish = (
                        "stop"
                        if state.stopped
                        else (FINISH.get(upd.finish_reason, "abort") if upd.finish_reason is not None else None)
                    )
                    piece = state.take(final=finish is not None)
                    before = n_out - len(upd.token_ids)  # tokens sent in earlier chunks
                    keep = max(0, len(state.kept_ids) - before) if state.stopped else len(upd.token_ids)
                    if piece or finish is not None:
                        yield _sse(chunk(piece, upd.token_ids[:keep], upd.topk[:keep], finish))
                    if finish is not None:
                        done = True
                        break
                    upd = await it.__anext__()
                if include_usage:
                    yield _sse(chunk(None, [], [], None, usage(len(stream.prompt_ids), len(state.kept_ids))))
                yield "data: [DONE]\n\n"
            except ApiError as e:
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
            except ClientGone:
                return  # `done` is False: aborted below
            finally:
                if not done or state.stopped:
                    loop.abort(stream, "client disconnected" if not done else "stop string reached")

        return StreamingResponse(gen(), media_type="text/event-stream")

    def usage(p: int, c: int) -> dict[str, int]:
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @app.get("/health")
    async def health() -> Response:
        ok = loop.alive
        return JSONResponse({"status": "ok" if ok else "engine loop stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            render_metrics(loop.snapshot, model_name), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "refengine",
                    "max_model_len": loop.engine.max_context,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        check_completion(body)
        prompts = [ids_of(p) for p in prompts_of(body.prompt)]
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        n_lp, stops, echo = body.logprobs, stop_list(body.stop), bool(body.echo)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def head(choices: list, **extra: Any) -> dict:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": body.model or model_name,
                "choices": choices,
                **extra,
            }

        if body.stream:
            if len(prompts) != 1:
                raise ApiError(400, "stream=true takes one prompt", "prompt")
            if echo:
                raise ApiError(400, "echo with stream=true is not supported", "echo")
            stream = loop.submit(prompts[0], params(max_tokens, n_lp))
            first = await first_update(stream, http)

            def chunk(text, ids, rows, finish, usage_=None):
                if text is None:
                    return head([], usage=usage_)
                lp = completion_logprobs(detok, ids, rows, n_lp) if n_lp is not None else None
                return head([{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}])

            inc = bool(body.stream_options and body.stream_options.get("include_usage"))
            return stream_response(stream, first, stops, http, chunk, inc)

        async def one(i: int, ids: list[int]) -> tuple[dict, int]:
            text, lp, finish, n_gen = "", None, "length", 0
            prompt_text = detok.decode(ids) if echo else ""
            if max_tokens > 0:
                state, rows, finish = await run_one(ids, params(max_tokens, n_lp), stops, http)
                text, n_gen = state.text, len(state.kept_ids)
                if n_lp is not None:
                    lp = completion_logprobs(detok, state.kept_ids, rows, n_lp, len(prompt_text))
            if echo and n_lp is not None:
                k = max(1, n_lp)
                scored = await asyncio.wrap_future(loop.call(lambda e: prompt_logprobs(e.target, ids, k)))
                toks = [detok.token(t) for t in ids]
                offs = [sum(len(t) for t in toks[:j]) for j in range(len(toks))]
                plp: dict[str, list] = {
                    "tokens": toks,
                    "token_logprobs": [r[0] if r else None for r in scored],
                    "top_logprobs": [
                        {detok.token(t): v for t, v in zip(r[1][:n_lp], r[2][:n_lp])} if r else None for r in scored
                    ],
                    "text_offset": offs,
                }
                lp = {key: plp[key] + (lp[key] if lp else []) for key in plp}
            return {"index": i, "text": prompt_text + text, "logprobs": lp, "finish_reason": finish}, n_gen

        results = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)])
        p_tok = sum(len(p) for p in prompts)
        return JSONResponse(head([c for c, _ in results], usage=usage(p_tok, sum(n for _, n in results))))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        check_chat(body)
        text = template.render(
            messages=[{"role": m.role, "content": m.text()} for m in body.messages], add_generation_prompt=True
        )
        ids = ids_of(text)
        max_tokens = body.max_completion_tokens or body.max_tokens or CHAT_DEFAULT_MAX_TOKENS
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        stops = stop_list(body.stop)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sp = params(max_tokens, n_lp)

        def head(obj: str, choices: list, **extra: Any) -> dict:
            return {
                "id": cid,
                "object": obj,
                "created": created,
                "model": body.model or model_name,
                "choices": choices,
                **extra,
            }

        if body.stream:
            stream = loop.submit(ids, sp)
            first = await first_update(stream, http)
            started = [False]

            def chunk(piece, tids, rows, finish, usage_=None):
                if piece is None:
                    return head("chat.completion.chunk", [], usage=usage_)
                delta: dict[str, Any] = {"content": piece}
                if not started[0]:
                    delta["role"], started[0] = "assistant", True
                lp = chat_logprobs(detok, tids, rows, n_lp) if n_lp is not None else None
                return head(
                    "chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]
                )

            inc = bool(body.stream_options and body.stream_options.get("include_usage"))
            return stream_response(stream, first, stops, http, chunk, inc)

        state, rows, finish = await run_one(ids, sp, stops, http)
        lp = chat_logprobs(detok, state.kept_ids, rows, n_lp) if n_lp is not None else None
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": state.text},
            "logprobs": lp,
            "finish_reason": finish,
        }
        return JSONResponse(head("chat.completion", [choice], usage=usage(len(ids), len(state.kept_ids))))

    return app
