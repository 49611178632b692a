"""`refengine memory`: the KV budget table, DFlash off vs on, from two config.json files.

    refengine memory --target PATH --draft PATH --gpu-mem-gib 16 --util 0.90
    refengine memory --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \
        --gpu-mem-gib 16 --accounting upstream --max-decode-batch 256     # upstream's 16 GB table

PATH is a checkpoint directory holding config.json, or the file itself. With --gpu-mem-gib the device is
described, not read; without it (and with CUDA) free/total memory are read from the device. No weights are
loaded either way, so what sits in memory before the pool is estimated: the target weights (exact, from
config.json) plus --runtime-overhead-mib (CUDA context + a worst-case step's activation peak), one value for
both rows or OFF,ON for two launches. Its default, 2810,2711 MiB, is what upstream's two launches on a 16 GB
card measured (solved back from its table, see refengine/memory/planner.py), so `--gpu-mem-gib 16 --accounting
upstream --max-decode-batch 256` prints that table; measure your own device
(refengine.memory.device.profile_activation_peak) and pass it. The other defaults (lane accounting, decode
batch, page size, utilisation) are the engine's own, so the table describes the setup the engine runs.
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from refengine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MEMORY_ACCOUNTING,
    DEFAULT_PAGE_SIZE,
    MEMORY_ACCOUNTINGS,
    ModelConfig,
)
from refengine.errors import KvBudgetError, RefEngineError
from refengine.memory.planner import DEFAULT_KV_MARGIN_BYTES, DeviceMemory, GiB, KvBudgetPlan, MiB, mib, plan_kv_budget
from refengine.memory.reservation import DFlashMemoryReservation, load_config, target_weight_bytes

DEFAULT_RUNTIME_OVERHEAD_MIB = "2810,2711"  # upstream's DFlash-off and DFlash-on launches (planner docstring)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {value}")
    return value


def _utilisation(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"wants a fraction in (0, 1], got {value}")
    return value


def _overheads(text: str) -> tuple[float, float]:
    """'X' (both rows) or 'OFF,ON' in MiB."""
    try:
        parts = [float(v) for v in str(text).split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--runtime-overhead-mib wants MiB as X or OFF,ON, got {text!r}") from e
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"--runtime-overhead-mib wants X or OFF,ON (>= 0), got {text!r}")
    return (parts[0], parts[-1])


HEADER = ("", "margin MiB", "KV budget MiB", "blocks", "B/block eff", "max context", "full-length reqs")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target checkpoint directory or its config.json")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory or config.json (omit: DFlash off only)")
    p.add_argument("--gpu-mem-gib", type=float, help="plan for a device of this many GiB instead of reading one")
    p.add_argument("--device", default="cuda", help="device to read when --gpu-mem-gib is not given")
    p.add_argument("--util", type=_utilisation, default=DEFAULT_GPU_MEMORY_UTILIZATION, help="gpu memory utilisation")
    p.add_argument("--page-size", type=_positive_int, default=DEFAULT_PAGE_SIZE)
    p.add_argument(
        "--max-decode-batch",
        type=_positive_int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"decode batch the drafter scratch is sized for (engine default {DEFAULT_MAX_NUM_SEQS}; "
        "upstream's table: 256)",
    )
    p.add_argument(
        "--max-context", type=_positive_int, help="tokens per full-length request (default: the model's limit)"
    )
    p.add_argument(
        "--accounting",
        choices=MEMORY_ACCOUNTINGS,
        default=DEFAULT_MEMORY_ACCOUNTING,
        help="DFlash reservation: 'lane' (what refengine allocates, the engine default) or 'upstream'",
    )
    p.add_argument("--margin-mib", type=int, default=DEFAULT_KV_MARGIN_BYTES // MiB)
    p.add_argument(
        "--runtime-overhead-mib",
        type=_overheads,
        default=_overheads(DEFAULT_RUNTIME_OVERHEAD_MIB),
        help="CUDA context + worst-case activation peak on top of the target weights, MiB: X for both "
        "rows or OFF,ON per launch (default: upstream's measured 2810,2711)",
    )


def add_memory_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `memory` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "memory",
        help="KV budget table, DFlash off vs on, from config.json files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run_memory)
    return p


def _device(args: argparse.Namespace) -> DeviceMemory | None:
    if args.gpu_mem_gib is not None:
        total = int(args.gpu_mem_gib * GiB)
        return DeviceMemory(total, total, f"{args.gpu_mem_gib:g} GiB given")
    import torch  # lazily: only needed to look for a device

    if not torch.cuda.is_available():
        return None
    from refengine.memory.device import read_device_memory

    return read_device_memory(args.device)


def _row(name: str, plan: KvBudgetPlan) -> tuple[str, ...]:
    return (
        name,
        str(mib(plan.margin_bytes)),
        str(mib(plan.kv_budget_bytes)),
        str(plan.num_blocks),
        f"{plan.effective_bytes_per_block:,}",
        str(plan.max_context_tokens),
        str(plan.max_full_length_requests),
    )


def _print_reservation(r: DFlashMemoryReservation) -> None:
    terms = r.terms()
    per_token = " + ".join(
        f"{k.removesuffix('_bytes_per_token')} {v:,}" for k, v in terms.items() if k.endswith("_per_token")
    )
    fixed = " + ".join(f"{k.removesuffix('_bytes')} {v:,}" for k, v in terms.items() if not k.endswith("_per_token"))
    print(
        f"DFlash reservation ({r.accounting} accounting, page {r.page_size}, decode batch {r.max_decode_batch}, "
        f"{r.dtype_bytes}-byte dtype):"
    )
    print(f"  per token  {per_token} = {r.per_token_bytes:,} B")
    print(f"  fixed      {fixed} = {r.fixed_bytes:,} B ({r.fixed_bytes / MiB:.1f} MiB)")
    print(
        f"  per block  {r.target_bytes_per_block:,} B in the pool -> {r.effective_bytes_per_block:,} B effective "
        f"(x{r.effective_factor:.3f})"
    )


def run_memory(args: argparse.Namespace) -> int:
    """Print the table and a JSON summary. 0: both rows planned; 1: a row does not fit; 2: bad input (a
    RefEngineError, printed by refengine.cli.main as one line)."""
    target = ModelConfig.from_hf(load_config(args.target), where="target")
    reservation = (
        None
        if args.draft is None
        else DFlashMemoryReservation.from_config(
            args.target,
            args.draft,
            page_size=args.page_size,
            max_decode_batch=args.max_decode_batch,
            accounting=args.accounting,
        )
    )
    device = _device(args)
    if device is None:
        print("refengine memory: no CUDA device; pass --gpu-mem-gib N to plan for a device of N GiB", file=sys.stderr)
        return 2
    weights = target_weight_bytes(target)
    loaded = device.after_loading(weights, "target weights")
    overheads = {"off": int(args.runtime_overhead_mib[0] * MiB), "on": int(args.runtime_overhead_mib[1] * MiB)}
    print(
        f"device: {mib(device.total_bytes)} MiB total, {mib(device.free_bytes)} MiB free ({device.source}); "
        f"utilisation {args.util:.2f}"
    )
    print(
        f"before the pool: target weights {mib(weights)} MiB (config.json) + runtime overhead off "
        f"{mib(overheads['off'])} / on {mib(overheads['on'])} MiB (--runtime-overhead-mib) "
        f"+ margin {args.margin_mib} MiB"
    )
    if reservation is not None:
        _print_reservation(reservation)

    summary: dict[str, Any] = {
        "command": "memory",
        "total_bytes": device.total_bytes,
        "free_bytes": device.free_bytes,
        "device_source": device.source,
        "target_weights_bytes": weights,
        "runtime_overhead_bytes": overheads,
        "reservation": None
        if reservation is None
        else {
            "accounting": reservation.accounting,
            **reservation.terms(),
            "per_token_bytes": reservation.per_token_bytes,
            "fixed_bytes": reservation.fixed_bytes,
            "bytes_per_block": reservation.target_bytes_per_block,
            "effective_bytes_per_block": reservation.effective_bytes_per_block,
        },
    }
    rows: list[tuple[str, ...]] = [HEADER]
    failed = False
    for name, key, res in (("DFlash off", "off", None), ("DFlash on", "on", reservation)):
        if key == "on" and reservation is None:
            summary[key] = None
            continue
        limit = res.max_context_tokens if res else target.max_position_embeddings
        try:
            plan = plan_kv_budget(
                loaded,
                target_config=target,
                gpu_memory_utilization=args.util,
                reservation=res,
                activation_peak_bytes=overheads[key],
                margin_bytes=args.margin_mib * MiB,
                page_size=args.page_size,
                max_context_tokens=min(args.max_context or limit, limit),
            )
        except RefEngineError as e:
            failed = failed or isinstance(e, KvBudgetError)
            rows.append((name, "does not fit", "", "", "", "", ""))
            print(f"{name}: {e}")
            summary[key] = {"error": str(e)}
            if not isinstance(e, KvBudgetError):
                print(json.dumps(summary))
                return 2
            continue
        rows.append(_row(name, plan))
        summary[key] = plan.summary()
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    print(json.dumps(summary))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="refengine memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    return run_memory(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
