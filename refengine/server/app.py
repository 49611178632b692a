"""FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version,
/health, /metrics.

Every handler runs on the server's event loop and only talks to the engine through the EngineLoop (commands
in, Updates out). What costs CPU in proportion to the request (parsing and validating the body, rendering the
chat template, tokenizing, detokenizing) runs in a small pool of worker threads (ServerConfig.prep_threads),
so /health answers while a large request is checked. Every error, routing ones included (404, 405), uses
OpenAI's body {"error": {message, type, param, code}}: 400 for what the engine cannot honour, 401 / 403 /
413 from the guard (guard.py), 404 for an unknown model, 429 when the waiting queue is full, 500 for an
internal failure (the request is finished and its KV freed first; no traceback in the body)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

import refengine
from refengine.errors import RefEngineError
from refengine.request import SamplingParams
from refengine.server.checks import Checker, bad, validate
from refengine.server.config import ServerConfig
from refengine.server.generate import ClientGone, caching, first_updates, run_one, stream_response, usage
from refengine.server.guard import Guard, read_body
from refengine.server.loop import EngineLoop, Stream
from refengine.server.metrics import CONTENT_TYPE, render_metrics
from refengine.server.protocol import ApiError, ChatMessage, DetokenizeRequest, TokenizeRequest, internal_error
from refengine.server.scoring import prompt_logprobs
from refengine.server.text import Detok, chat_logprobs, completion_logprobs
from refengine.validation import validate_prompt

log = logging.getLogger("refengine.server")


def create_app(loop: EngineLoop, detok: Detok, cfg: ServerConfig, chat_template: str) -> Any:
    """The ASGI app: the FastAPI routes behind the Guard middleware."""
    import jinja2.sandbox

    app = FastAPI(title="refengine", docs_url=None, redoc_url=None, openapi_url=None)
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        chat_template
    )
    eng = loop.engine
    checker = Checker(cfg, detok, eng.target.cfg.vocab_size, eng.max_context, frozenset(eng.scheduler.eos_ids))
    pool = ThreadPoolExecutor(cfg.prep_threads, thread_name_prefix="refengine-prep")
    app.state.prep_pool = pool
    model_name = cfg.model_name

    async def off(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def submit_choices(prompts: list[list[int]], params: list[SamplingParams]) -> list[Stream]:
        """One stream per choice (its prompt and SamplingParams): all submitted, or none (a 429)."""
        loop.reserve(len(prompts))  # then every submit at once: no await in between
        return [loop.submit(ids, sp, reserved=True) for ids, sp in zip(prompts, params)]

    def render(messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        try:
            return template.render(
                messages=[{"role": m.role, "content": m.text()} for m in messages],
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise bad(f"the chat template rejected the messages: {e}", "messages") from e

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_req: Request, _e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the request was aborted

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = ApiError(e.status_code, str(e.detail), None, "invalid_request_error", code)
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in a handler")
        return JSONResponse(internal_error(f"internal error ({type(e).__name__})").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        ok = loop.alive
        return JSONResponse({"status": "ok" if ok else "engine loop stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(loop.snapshot, model_name), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": refengine.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "refengine"}
        return {"object": "list", "data": [card | {"max_model_len": eng.max_context}]}

    @app.post("/tokenize")
    async def tokenize(http: Request) -> dict:
        def work(body: bytes) -> list[int]:
            from refengine.server.checks import parse_json

            r = validate(TokenizeRequest, parse_json(body))
            checker.model_of(r)
            if (r.prompt is None) == (r.messages is None):
                raise bad("send one of prompt or messages", "prompt")
            text = r.prompt if r.prompt is not None else render(r.messages or [], r.add_generation_prompt is not False)
            return checker.ids(text)

        ids = await off(work, await read_body(http, cfg.max_request_bytes))
        return {"count": len(ids), "max_model_len": eng.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: Request) -> dict:
        def work(body: bytes) -> str:
            from refengine.server.checks import parse_json

            r = validate(DetokenizeRequest, parse_json(body))
            checker.model_of(r)
            try:
                return detok.decode(validate_prompt(r.tokens, checker.vocab))
            except (RefEngineError, ValueError) as e:
                raise bad(str(e), "tokens") from e

        return {"prompt": await off(work, await read_body(http, cfg.max_request_bytes))}

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        r, prep = await off(checker.completion, await read_body(http, cfg.max_request_bytes))
        echo = bool(r.echo)
        n_lp = prep.n_logprobs
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def head(choices: list, **extra: Any) -> dict:
            obj = "text_completion"
            return {"id": cid, "object": obj, "created": created, "model": model_name, "choices": choices, **extra}

        if prep.stream:  # one prompt (checks.py), its n choices
            streams = submit_choices([prep.prompts[0]] * prep.n, prep.choice_params())
            firsts = await first_updates(loop, streams, http)
            started = [False] * len(streams)

            def chunk(i: int, text: str, ids: list[int], rows: list, offs: list[int], finish: str | None) -> dict:
                lp = completion_logprobs(detok, ids, rows, n_lp, offs) if n_lp is not None else None
                choice: dict[str, Any] = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                if prep.return_token_ids:  # vLLM's: the prompt's ids in a choice's first chunk, then delta ids
                    if not started[i]:
                        choice["prompt_token_ids"], started[i] = prep.prompts[0], True
                    choice["token_ids"] = ids
                return head([choice])

            return stream_response(loop, detok, streams, firsts, prep, http, chunk, lambda u: head([], usage=u))

        async def one(i: int, ids: list[int], prompt_text: str, stream: Stream | None) -> tuple[dict, int, int]:
            text, lp, finish, n_gen, cached = "", None, "length", 0, 0
            kept: list[int] = []
            if stream is not None:
                c = await run_one(loop, detok, stream, prep, http)
                st, finish, cached = c.state, c.finish or "abort", c.cached_tokens
                kept = st.kept_ids
                text, n_gen = st.text, len(kept)
                if n_lp is not None:
                    lp = completion_logprobs(detok, kept, c.rows, n_lp, st.offsets(0, len(kept), len(prompt_text)))
            if echo and n_lp is not None:
                k = max(1, n_lp)
                scored = await asyncio.wrap_future(loop.call(lambda e: prompt_logprobs(e.target, ids, k)))
                toks = [detok.token(t) for t in ids]
                offs = [sum(len(t) for t in toks[:j]) for j in range(len(toks))]
                plp: dict[str, list] = {
                    "tokens": toks,
                    "token_logprobs": [row[0] if row else None for row in scored],
                    "top_logprobs": [
                        {detok.token(t): v for t, v in zip(row[1][:n_lp], row[2][:n_lp])} if row else None
                        for row in scored
                    ],
                    "text_offset": offs,
                }
                lp = {key: plp[key] + (lp[key] if lp else []) for key in plp}
            choice = {"index": i, "text": prompt_text + text, "logprobs": lp, "finish_reason": finish}
            if prep.return_token_ids:
                choice |= {"prompt_token_ids": ids, "token_ids": kept}
            return choice, n_gen, cached

        # choice i * n + j is prompt i's j-th (OpenAI's order); each has its own stream
        prompts = [ids for ids in prep.prompts for _ in range(prep.n)]
        texts = [await off(detok.decode, ids) if echo else "" for ids in prompts]
        choice_streams: list[Stream | None] = [None] * len(prompts)
        if prep.max_tokens > 0:
            choice_streams = list(submit_choices(prompts, prep.choice_params() * len(prep.prompts)))
        try:
            results = await asyncio.gather(*[one(i, *x) for i, x in enumerate(zip(prompts, texts, choice_streams))])
        except BaseException:
            for s in choice_streams:
                if s is not None:
                    loop.abort(s, "another prompt of the request failed")
            raise
        p_tok = sum(len(p) for p in prep.prompts)
        # each prompt counts once in prompt_tokens, and so in cached_tokens: as its first choice's (index i*n)
        cached = sum(results[i][2] for i in range(0, len(results), prep.n)) if caching(loop) else None
        return JSONResponse(head([c for c, _, _ in results], usage=usage(p_tok, sum(n for _, n, _ in results), cached)))

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Response:
        _r, prep = await off(checker.chat, await read_body(http, cfg.max_request_bytes), render)
        ids, n_lp = prep.prompts[0], prep.n_logprobs
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def head(obj: str, choices: list, **extra: Any) -> dict:
            return {"id": cid, "object": obj, "created": created, "model": model_name, "choices": choices, **extra}

        streams = submit_choices([ids] * prep.n, prep.choice_params())
        if prep.stream:
            firsts = await first_updates(loop, streams, http)
            started = [False] * len(streams)
            first_chunk = [True] * len(streams)

            def chunk(i: int, piece: str, tids: list[int], rows: list, _offs: list[int], finish: str | None) -> dict:
                delta: dict[str, Any] = {"content": piece}
                if not started[i]:
                    delta["role"], started[i] = "assistant", True
                lp = chat_logprobs(detok, tids, rows, n_lp) if n_lp is not None else None
                choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
                extra: dict[str, Any] = {}
                if prep.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk, then delta ids
                    choice["token_ids"] = tids
                    if first_chunk[i]:
                        extra["prompt_token_ids"], first_chunk[i] = ids, False
                return head("chat.completion.chunk", [choice], **extra)

            return stream_response(
                loop, detok, streams, firsts, prep, http, chunk, lambda u: head("chat.completion.chunk", [], usage=u)
            )

        try:
            done = await asyncio.gather(*[run_one(loop, detok, s, prep, http) for s in streams])
        except BaseException:
            for s in streams:
                loop.abort(s, "another choice of the request failed")
            raise
        choices = [
            {
                "index": j,
                "message": {"role": "assistant", "content": c.state.text},
                "logprobs": chat_logprobs(detok, c.state.kept_ids, c.rows, n_lp) if n_lp is not None else None,
                "finish_reason": c.finish or "abort",
                **({"token_ids": c.state.kept_ids} if prep.return_token_ids else {}),
            }
            for j, c in enumerate(done)
        ]
        n_gen = sum(len(c.state.kept_ids) for c in done)
        cached = done[0].cached_tokens if caching(loop) else None
        extra = {"prompt_token_ids": ids} if prep.return_token_ids else {}  # vLLM's: once, beside the choices
        return JSONResponse(head("chat.completion", choices, usage=usage(len(ids), n_gen, cached), **extra))

    return Guard(app, cfg)
