"""`refengine generate | memory | bench`: the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from refengine.bench import add_bench_parser
from refengine.config import DRAFT_SAMPLINGS, SPECULATION_MODES
from refengine.defaults import add_model_arguments, add_prefix_caching_argument
from refengine.errors import RefEngineError
from refengine.memory.cli import add_memory_parser


def _load_tokenizer(target: Path):
    if not (target / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target / "tokenizer.json"))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise RefEngineError(
            f"this checkpoint has no tokenizer.json: give the prompt as token ids ('1 2 3' or '1,2,3'), got {text!r}"
        ) from e


def cmd_generate(args) -> int:
    import torch

    from refengine import Engine, EngineConfig, SamplingParams
    from refengine.defaults import model_pair
    from refengine.validation import decode_prompt_arg

    target, draft = model_pair(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = _load_tokenizer(Path(target))
    params = SamplingParams(  # fails before any load
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompt_text = (
        decode_prompt_arg(args.prompt)
        if args.prompt is not None
        else ("def fibonacci(n):" if tok else "1 2 3 4 5 6 7 8")
    )
    prompt_ids = tok.encode(prompt_text).ids if tok else _parse_ids(prompt_text)
    engine = Engine(
        EngineConfig(
            str(target),
            draft_path=str(draft) if draft else None,
            device=device,
            dtype=args.dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            speculation=args.speculation,
            draft_sampling=args.draft_sampling,
        )
    )
    t0 = time.perf_counter()
    (req,) = engine.generate([prompt_ids], params)
    elapsed = time.perf_counter() - t0
    if req.reject_reason is not None:
        print(f"rejected ({req.reject_reason.value}): {req.message}", file=sys.stderr)
        return 2
    text = tok.decode(req.output_ids) if tok else " ".join(map(str, req.output_ids))
    print(prompt_text + text if tok else text)
    n = len(req.output_ids)
    print(
        f"\n[{n} tokens in {elapsed:.2f}s: {n / elapsed:.1f} tok/s | {device} {engine.config.torch_dtype_name} "
        f"| finish {req.finish_reason.value if req.finish_reason else '?'} | target {target}]",
        file=sys.stderr,
    )
    stats: dict[str, object] = {"tokens": n, "seconds": round(elapsed, 4), "tok_per_s": round(n / elapsed, 2)}
    if engine.proposer is not None:
        s = req.spec
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s.accepted_hist.items()))
        print(
            f"[dflash {draft}: tau {s.tau:.2f} tokens/verify over {s.verify_steps} steps | accepted-length "
            f"histogram {hist} | draft {s.draft_s * 1e3:.1f} ms, verify {s.verify_s * 1e3:.1f} ms]",
            file=sys.stderr,
        )
        stats.update(
            tau=round(s.tau, 3),
            verify_steps=s.verify_steps,
            accepted_hist={str(k): v for k, v in sorted(s.accepted_hist.items())},
            draft_ms=round(s.draft_s * 1e3, 2),
            verify_ms=round(s.verify_s * 1e3, 2),
            speculation=engine.span_stats(),
        )
    print(json.dumps(stats))
    return 0


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """SamplingParams' sampling fields and EngineConfig.draft_sampling (values checked by those classes)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (default 1: off)")
    parser.add_argument(
        "--seed",
        type=int,
        help="the request's random stream: the same seed gives the same text (default: a fresh one each run)",
    )
    parser.add_argument(
        "--draft-sampling",
        choices=DRAFT_SAMPLINGS,
        default="sampled",
        help="at temperature > 0 the drafter's drafts are sampled from its processed distribution (default) or "
        "its argmax; either is lossless",
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr (exit 2), like every other refengine error; --help has the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="refengine", description="Reference engine for DFlash on Qwen3")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generation, greedy or sampled (with DFlash when a drafter is given)")
    add_model_arguments(g)
    g.add_argument("--prompt", help="prompt text (token ids when the checkpoint has no tokenizer)")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="new tokens (default 256: the length the tiny pair's tau is measured at)",
    )
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    g.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default="fixed",
        help="span policy: fixed (every drafting step a full block) or adaptive (GoodputSpans: spans per step from "
        "measured step costs and acceptance; 1 = plain decode). Outputs are the same either way",
    )
    add_sampling_arguments(g)
    add_prefix_caching_argument(g)
    g.set_defaults(func=cmd_generate)
    add_memory_parser(sub)
    add_bench_parser(sub)
    from refengine.server.cli import add_server_parsers  # the server's imports (fastapi) load only when run

    add_server_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RefEngineError as e:
        print(f"refengine: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
