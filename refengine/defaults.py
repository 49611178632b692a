"""Where the embedded fixture pairs live (shipped inside the package tree; no network, ever), and the
--model / --dflash-draft-model-path / --no-draft options every command that runs a pair shares, and the
options several commands share (--fused-ops, --enable-prefix-caching)."""

from __future__ import annotations

import argparse
from pathlib import Path

from refengine.config import DEFAULT_FUSED_OPS, FUSED_OPS, check_fused_ops
from refengine.errors import UnsupportedConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRAINED_PAIR = FIXTURES / "tiny-trained"
RANDOM_PAIR = FIXTURES / "tiny-random"


def default_pair() -> tuple[Path, Path]:
    """The trained tiny pair when present (it has a tokenizer and real acceptance), else the random one."""
    for pair in (TRAINED_PAIR, RANDOM_PAIR):
        if (pair / "target" / "config.json").is_file() and (pair / "draft" / "config.json").is_file():
            return pair / "target", pair / "draft"
    raise FileNotFoundError(f"no fixture pair under {FIXTURES} (run python -m fixtures.build.random_pair)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="target checkpoint dir (default: the embedded tiny pair)")
    parser.add_argument(
        "--dflash-draft-model-path",
        "--draft",
        type=Path,
        dest="dflash_draft_model_path",
        help="DFlash drafter checkpoint dir (default with no --model: the embedded drafter)",
    )
    parser.add_argument("--no-draft", action="store_true", help="plain decoding even for the embedded pair")


def model_pair(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(target, drafter or None) from add_model_arguments' options: the embedded pair unless --model."""
    draft: Path | None
    if args.model is None:
        target, draft = default_pair()
        draft = args.dflash_draft_model_path or draft
    else:
        target, draft = Path(args.model), args.dflash_draft_model_path
    return target, None if args.no_draft else draft


def add_fused_ops_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fused-ops",
        type=fused_ops_arg,
        default=None,
        help=f"fused kernels the graphed forwards use on CUDA: comma-separated subset of {','.join(FUSED_OPS)}, "
        f"or 'none' (default: {','.join(DEFAULT_FUSED_OPS)}; EngineConfig.fused_ops)",
    )


def fused_ops_arg(text: str) -> tuple[str, ...]:
    """--fused-ops' value: the named ops ('none': no fused kernel); unknown names are refused here."""
    ops = tuple(o.strip() for o in text.split(",") if o.strip() and o.strip() != "none")
    try:
        check_fused_ops(ops)
    except UnsupportedConfigError as e:
        raise argparse.ArgumentTypeError(f"{e}, or 'none'") from e
    return ops


def add_prefix_caching_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="share the KV (and the drafter's tap features) of cached full prompt blocks between requests "
        "(EngineConfig.enable_prefix_caching); outputs are the same either way",
    )
