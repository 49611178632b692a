"""The engine loop: one background thread owns the Engine (which is not thread-safe) and runs continuous
batching across all HTTP requests.

HTTP handlers talk to it only through thread-safe commands on a queue.Queue (add, abort, call) and receive
Updates on a per-request asyncio.Queue fed with loop.call_soon_threadsafe. After every engine step the thread
publishes each live request's new tokens and a metrics snapshot (read by /metrics without touching the
engine). A request whose handler goes away (client disconnect, stop string hit) is aborted with
Engine.abort: its KV blocks and drafter context are freed at once."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from refengine.engine import Engine
from refengine.errors import RefEngineError
from refengine.request import FinishReason, Request, SamplingParams, SpecStats
from refengine.runner.logits import TopK
from refengine.server.protocol import ApiError, internal_error

log = logging.getLogger("refengine.server")
IDLE_WAIT_S = 0.05  # how long the idle loop blocks on the command queue before checking for shutdown
RETRY_AFTER_S = 1  # the Retry-After of a 429 (server busy)


@dataclass
class Update:
    """New committed tokens of one request (and their top-k rows when it asked for logprobs), or its end."""

    token_ids: list[int] = field(default_factory=list)
    topk: list[TopK] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ApiError | None = None
    cached_tokens: int = 0  # prompt tokens the request took from the prefix cache (Request.cached_tokens)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Stream:
    """One engine request as an HTTP handler sees it: an asyncio queue of Updates on the handler's loop."""

    def __init__(self, aloop: asyncio.AbstractEventLoop, prompt_ids: list[int], params: SamplingParams):
        self.aloop, self.prompt_ids, self.params = aloop, prompt_ids, params
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.request_id: int | None = None
        self.closed = False  # its outstanding slot was given back (set on the loop thread)

    def push(self, update: Update) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the handler's event loop is closed (server shutting down)
            pass


@dataclass
class _Live:
    stream: Stream
    req: Request
    sent: int = 0


class EngineLoop:
    """`max_outstanding`: requests submitted and not yet finished (running + waiting + queued commands) past
    which submit raises a 429 ApiError with Retry-After; None: unbounded."""

    def __init__(self, engine: Engine, max_outstanding: int | None = None):
        self.engine = engine
        self.max_outstanding = max_outstanding
        self.outstanding = 0
        self.rejected_busy = 0
        self._lock = threading.Lock()
        self._cmds: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self._live: dict[int, _Live] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refengine-engine-loop", daemon=True)
        self.spec = SpecStats()
        self.finished: Counter[str] = Counter()
        self.tokens_generated = 0
        self.snapshot: dict[str, Any] = {}
        self._publish_snapshot()

    # ---- called from any thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def reserve(self, n: int) -> None:
        """Take n outstanding slots (one per submit to come), or raise a 429 ApiError taking none."""
        with self._lock:
            if self.max_outstanding is not None and self.outstanding + n > self.max_outstanding:
                self.rejected_busy += 1
                raise ApiError(
                    429,
                    f"the server is busy ({self.outstanding} requests running or waiting, at most "
                    f"{self.max_outstanding}): retry later",
                    None,
                    "rate_limit_error",
                    "server_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self.outstanding += n

    def submit(self, prompt_ids: list[int], params: SamplingParams, reserved: bool = False) -> Stream:
        """From a coroutine: queue a generation; Updates arrive on the returned Stream's queue. Takes an
        outstanding slot unless `reserved` (reserve() took it)."""
        if not reserved:
            self.reserve(1)
        stream = Stream(asyncio.get_running_loop(), prompt_ids, params)
        self._cmds.put(("add", stream, None))
        return stream

    def _close(self, stream: Stream) -> None:
        if not stream.closed:
            stream.closed = True
            with self._lock:
                self.outstanding -= 1

    def abort(self, stream: Stream, message: str = "aborted by the server") -> None:
        self._cmds.put(("abort", stream, message))

    def abort_all(self, message: str) -> None:
        """End every running request with a 503 (graceful shutdown's deadline): handlers answer it, streams
        send it as their last event."""
        self._cmds.put(("abort_all", message, None))

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run fn(engine) on the loop thread between steps (e.g. prompt scoring); a Future of its result."""
        fut: Future = Future()
        self._cmds.put(("call", fn, fut))
        return fut

    # ---- the loop thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                try:
                    self.engine.step()
                except Exception as e:  # noqa: BLE001 - any failure: finish everyone cleanly, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
            self._publish()
        self._fail_all("server shutting down")
        while True:  # adds queued behind the stop are answered too
            try:
                kind, a, _ = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._close(a)
                a.push(Update(error=ApiError(503, "server shutting down", None, "server_error", "shutting_down")))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=IDLE_WAIT_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, a: Any, b: Any) -> None:
        if kind == "add":
            self._add(a)
        elif kind == "abort":
            self._abort(a, b)
        elif kind == "abort_all":
            for live in list(self._live.values()):
                self._abort(live.stream, a, notify=False)
                live.stream.push(Update(error=ApiError(503, a, None, "server_error", "shutting_down")))
        elif kind == "call":
            fut: Future = b
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(a(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _add(self, stream: Stream) -> None:
        try:
            req = self.engine.add_request(stream.prompt_ids, stream.params)
        except RefEngineError as e:
            self._close(stream)
            stream.push(Update(error=ApiError(400, str(e), "prompt")))
            return
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            self._close(stream)
            stream.push(Update(error=internal_error(f"{type(e).__name__}: {e}")))
            return
        stream.request_id = req.request_id
        if req.reject_reason is not None:
            self.finished["rejected"] += 1
            self._close(stream)
            param = "prompt" if req.reject_reason.value == "invalid" else "max_tokens"
            stream.push(Update(error=ApiError(400, req.message, param, code=req.reject_reason.value)))
            return
        self._live[req.request_id] = _Live(stream, req)

    def _abort(self, stream: Stream, message: str, notify: bool = True) -> None:
        rid = stream.request_id
        if rid is None or rid not in self._live:
            return  # never admitted, or already finished
        del self._live[rid]
        self._close(stream)
        try:
            self.engine.abort(rid, message)
        except Exception:  # noqa: BLE001
            log.exception("abort of request %s failed", rid)
        if notify:
            stream.push(Update(finish_reason=FinishReason.ABORTED))

    def _fail_all(self, message: str) -> None:
        for live in list(self._live.values()):
            self._abort(live.stream, message, notify=False)
            live.stream.push(Update(error=internal_error(message)))

    def _publish(self) -> None:
        # finished requests go into the totals and the snapshot first: a client that saw its answer end then
        # reads /metrics counting it
        for r in self.engine.finished:  # (the engine's list would grow forever otherwise)
            self.spec.merge(r.spec)
            self.finished[r.finish_reason.value if r.finish_reason else "unknown"] += 1
        self.engine.finished.clear()
        self._publish_snapshot()
        for rid, live in list(self._live.items()):
            req = live.req
            new = req.output_ids[live.sent :]
            if not new and not req.finished:
                continue
            rows = req.topk[live.sent : live.sent + len(new)] if req.params.logprobs else []
            live.sent += len(new)
            self.tokens_generated += len(new)
            if req.finish_reason is FinishReason.ERROR:  # the engine failed the request's steps itself
                live.stream.push(Update(error=internal_error(req.message or "engine error")))
            else:
                finish = req.finish_reason if req.finished else None
                live.stream.push(Update(list(new), list(rows), finish, cached_tokens=req.cached_tokens))
            if req.finished:
                del self._live[rid]
                self._close(live.stream)

    def _publish_snapshot(self) -> None:
        eng = self.engine
        alloc = eng.pool.allocator
        self.snapshot = {  # replaced whole: readers on other threads see one consistent dict
            "time": time.time(),
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "kv_blocks_used": alloc.num_blocks - alloc.num_free,
            "kv_blocks_free": alloc.num_free,
            "kv_blocks_total": alloc.num_blocks,
            "speculative": eng.proposer is not None,
            "tau": self.spec.tau,
            "verify_steps": self.spec.verify_steps,
            "committed_tokens": self.spec.committed_tokens,
            "accepted_hist": dict(self.spec.accepted_hist),
            "timings": dict(eng.runner.timings),
            "finished": dict(self.finished),
            "tokens_generated": self.tokens_generated,
            "live_streams": len(self._live),
            "outstanding": self.outstanding,
            "rejected_busy": self.rejected_busy,
            "span": self._span_stats(),
            "prefix_cache": eng.prefix_cache_stats(),
        }

    def _span_stats(self) -> dict[str, Any]:
        """The span policy's chosen spans and errors (Engine.span_stats, without its detail)."""
        try:
            st = self.engine.span_stats()
        except Exception:  # noqa: BLE001 - metrics must not take the loop down
            log.exception("Engine.span_stats failed")
            return {"policy": "unknown", "spans": {}, "errors": 0}
        return {"policy": st.get("policy", "?"), "spans": dict(st.get("spans", {})), "errors": st.get("errors", 0)}
