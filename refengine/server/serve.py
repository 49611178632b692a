"""`refengine serve`: build the engine, the engine loop and the app, and run uvicorn (in the foreground, or
in a background thread for tests via BackgroundServer)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refengine.defaults import add_model_arguments

log = logging.getLogger("refengine.server")
SHUTDOWN_BACKSTOP_S = 5  # uvicorn cancels what is left this long after --shutdown-timeout

if TYPE_CHECKING:  # the server modules import pydantic/fastapi: only loaded when serving
    from refengine.config import EngineConfig
    from refengine.engine import Engine
    from refengine.server.config import ServerConfig
    from refengine.server.loop import EngineLoop
    from refengine.server.text import Detok


def chat_template_of(target: Path) -> str:
    """The tokenizer's chat template (tokenizer_config.json `chat_template`), else ChatML (CHATML_TEMPLATE)."""
    from refengine.server.protocol import CHATML_TEMPLATE

    cfg = target / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, str) and t:
            return t
    return CHATML_TEMPLATE


def detok_of(target: Path) -> Detok:
    from refengine.server.text import Detok

    if not (target / "tokenizer.json").is_file():
        return Detok(None)
    from tokenizers import Tokenizer

    return Detok(Tokenizer.from_file(str(target / "tokenizer.json")))


def default_model_name(target: Path) -> str:
    return target.parent.name if target.name == "target" else target.name


def make_app(engine: Engine, cfg: ServerConfig | None = None) -> tuple[Any, EngineLoop]:
    """The ASGI app and its (started) engine loop for an engine; cfg defaults to ServerConfig's defaults with
    the checkpoint's model name."""
    from refengine.server.app import create_app
    from refengine.server.config import ServerConfig
    from refengine.server.loop import EngineLoop

    target = Path(engine.config.target_path)
    cfg = cfg or ServerConfig(default_model_name(target))
    loop = EngineLoop(engine, max_outstanding=engine.config.max_num_seqs + cfg.max_waiting)
    loop.start()
    return create_app(loop, detok_of(target), cfg, chat_template_of(target)), loop


def graceful_server(app: Any, loop: EngineLoop, timeout: float, **config: Any) -> Any:
    """A uvicorn.Server whose shutdown (SIGTERM, SIGINT, should_exit) stops accepting, lets running requests
    finish for `timeout` seconds, then aborts the rest through the engine loop (each handler answers 503, each
    stream ends with a 503 error event), so no task is left for uvicorn to cancel; uvicorn's own graceful
    timeout (a few seconds later) stays as the backstop."""
    import asyncio

    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            async def deadline() -> None:
                await asyncio.sleep(timeout)
                log.warning("shutdown: aborting the requests still running after %.1fs", timeout)
                loop.abort_all("server shutting down: the request was aborted")

            task = asyncio.create_task(deadline())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

    cfg = uvicorn.Config(app, timeout_graceful_shutdown=math.ceil(timeout) + SHUTDOWN_BACKSTOP_S, **config)
    return GracefulServer(cfg)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn.Server in a daemon thread on host:port (a free loopback port by default); stop() tears down
    both the HTTP server and the engine loop. ServerConfig fields may be given as keywords."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int | None = None,
        model_name: str | None = None,
        start_timeout: float = 30.0,
        **server: Any,
    ):

        from refengine.server.config import ServerConfig

        name = model_name or default_model_name(Path(engine.config.target_path))
        server.setdefault("shutdown_timeout", 2.0)
        self.config = ServerConfig(name, host=host, **server)
        self.app, self.loop = make_app(engine, self.config)
        self.host, self.port = host, port or free_port(host)
        self.server = graceful_server(
            self.app, self.loop, self.config.shutdown_timeout, host=self.host, port=self.port, log_level="warning"
        )
        self.thread = threading.Thread(target=self.server.run, name="refengine-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.loop.stop()
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.loop.stop(timeout)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig `refengine serve` builds from its flags (validated by EngineConfig itself)."""
    import torch

    from refengine.config import EngineConfig
    from refengine.defaults import model_pair

    target, draft = model_pair(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kw: dict[str, Any] = {
        "speculation": args.speculation,
        "draft_sampling": args.draft_sampling,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return EngineConfig(str(target), draft_path=str(draft) if draft else None, device=device, **kw)


def server_config(args: argparse.Namespace, target: Path) -> ServerConfig:
    from refengine.server.config import ServerConfig

    return ServerConfig(
        args.served_model_name or default_model_name(target),
        host=args.host,
        max_request_bytes=args.max_request_bytes,
        max_waiting=args.max_waiting,
        max_prompts=args.max_prompts,
        max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars,
        api_key=args.api_key or os.environ.get("REFENGINE_API_KEY") or None,
        allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
        shutdown_timeout=args.shutdown_timeout,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT: then stop accepting, give running requests --shutdown-timeout seconds,
    abort the rest, stop the engine loop and exit 0."""

    from refengine.engine import Engine

    cfg = engine_config(args)
    scfg = server_config(args, Path(cfg.target_path))  # flags checked before the model loads
    engine = Engine(cfg)
    engine.capture_graphs()  # every CUDA graph shape before the first request (a no-op in eager mode)
    app, loop = make_app(engine, scfg)
    print(
        f"refengine serve: {cfg.target_path} (drafter {cfg.draft_path or 'off'}, speculation {cfg.speculation}, "
        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}) "
        f"on {cfg.device}, http://{args.host}:{args.port}/v1",
        flush=True,
    )
    if scfg.bind_warning:
        print(scfg.bind_warning, file=sys.stderr, flush=True)
    server = graceful_server(app, loop, scfg.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)
    # uvicorn re-raises a caught SIGTERM / SIGINT after its graceful shutdown, through the handlers it found
    # installed: these make that a no-op, so the process finishes its cleanup and exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        loop.stop()
    print("refengine serve: stopped", flush=True)
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_arguments(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-num-seqs", type=int, help="running batch cap (default: the engine's)")
    s.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: the share of the device's memory this server plans for (default: the engine's); give each "
        "server on a shared device its own share",
    )
    s.add_argument(
        "--speculation",
        choices=["fixed", "adaptive"],
        default="fixed",
        help="verify span policy: fixed (the drafter's block every step) or adaptive (chosen per step); "
        "/metrics exports the chosen spans (refengine_spec_span_steps_total)",
    )
    s.add_argument(
        "--draft-sampling",
        choices=["sampled", "greedy"],
        default="sampled",
        help="a request at temperature > 0 drafts from the drafter's processed distribution (sampled) or its "
        "argmax (greedy); either is lossless",
    )
    from refengine.defaults import add_prefix_caching_argument

    add_prefix_caching_argument(s)
    s.add_argument("--served-model-name", help="the model id /v1/models reports (default: the checkpoint's)")
    s.add_argument("--log-level", default="info")
    from dataclasses import fields

    from refengine.server.config import ServerConfig  # stdlib-only: no server dependency needed to build the CLI

    d = argparse.Namespace(**{f.name: f.default for f in fields(ServerConfig) if f.init})
    s.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` (default: $REFENGINE_API_KEY; /health, "
        "/metrics and /version stay open)",
    )
    s.add_argument(
        "--allowed-hosts",
        nargs="+",
        metavar="HOST",
        help="Host header names accepted (default: the "
        "loopback names on a loopback bind, a DNS-rebinding guard; any on other binds)",
    )
    s.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="413 above this body size")
    s.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="requests waiting beyond the running batch before new ones get 429 + Retry-After",
    )
    s.add_argument(
        "--max-prompts", type=int, default=d.max_prompts, help="prompts per /v1/completions request (and prompts x n)"
    )
    s.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    s.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="seconds SIGTERM waits for running requests before aborting them (then exit 0)",
    )
    s.set_defaults(func=cmd_serve)
