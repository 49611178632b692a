"""`refengine serve`: build the engine, the engine loop and the app, and run uvicorn (in the foreground, or
in a background thread for tests via BackgroundServer)."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refengine.defaults import add_model_arguments

if TYPE_CHECKING:  # the server modules import pydantic/fastapi: only loaded when serving
    from refengine.config import EngineConfig
    from refengine.engine import Engine
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


def make_app(engine: Engine, model_name: str | None = None) -> tuple[Any, EngineLoop]:
    """The FastAPI app and its (started) engine loop for an engine."""
    from refengine.server.app import create_app
    from refengine.server.loop import EngineLoop

    target = Path(engine.config.target_path)
    loop = EngineLoop(engine)
    loop.start()
    return create_app(loop, detok_of(target), model_name or default_model_name(target), chat_template_of(target)), loop


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn.Server in a daemon thread on host:port (a free loopback port by default); stop() tears down
    both the HTTP server and the engine loop."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int | None = None,
        model_name: str | None = None,
        start_timeout: float = 30.0,
    ):
        import uvicorn

        self.app, self.loop = make_app(engine, model_name)
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", timeout_graceful_shutdown=2)
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
    kw: dict[str, Any] = {"speculation": args.speculation}
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    return EngineConfig(str(target), draft_path=str(draft) if draft else None, device=device, **kw)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from refengine.engine import Engine

    cfg = engine_config(args)
    target, draft, device = cfg.target_path, cfg.draft_path, cfg.device
    engine = Engine(cfg)
    engine.capture_graphs()  # every CUDA graph shape before the first request (a no-op in eager mode)
    app, loop = make_app(engine, args.served_model_name)
    print(
        f"refengine serve: {target} (drafter {draft or 'off'}) on {device}, http://{args.host}:{args.port}/v1",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()
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
        "--speculation",
        choices=["fixed", "adaptive"],
        default="fixed",
        help="verify span policy: fixed (the drafter's block every step) or adaptive (chosen per step); "
        "/metrics exports the chosen spans (refengine_spec_span_steps_total)",
    )
    s.add_argument("--served-model-name", help="the model id /v1/models reports (default: the checkpoint's)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)
