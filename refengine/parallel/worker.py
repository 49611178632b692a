"""The loop of a tensor-parallel rank > 0 (one spawned process per rank, started by TensorParallelGroup).

It loads the target, keeps its own shard, allocates its KV pool (this rank's KV heads, the same number of
blocks as rank 0, so rank 0's block ids and slots address it unchanged), tells rank 0 it is ready, joins the
process group, then runs every forward rank 0 sends over its pipe: the same forward on its shard, joining
rank 0's all-reduces. It holds no scheduler, no allocator state and no drafter, and reads no logits.
It exits when rank 0 sends None, when the pipe closes (rank 0 died) or when a collective fails.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from refengine.config import EngineConfig


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    store_file: str
    num_blocks: int
    dummy_blocks: int


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank on the CPU; cuda:(first + rank) on CUDA, one GPU per rank."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_group(config: EngineConfig, rank: int, store_file: str) -> None:
    import torch.distributed as dist

    tp = config.tensor_parallel_size
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank_device(config.device, rank))
    dist.init_process_group(
        backend_for(config.device),
        store=dist.FileStore(store_file, tp),
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=config.tensor_parallel_timeout_s),
    )


def worker_main(args: WorkerArgs, conn) -> None:
    import torch.distributed as dist

    from refengine.attention import make_backend
    from refengine.attention.base import AttnBatch
    from refengine.kv.pool import KvPool
    from refengine.models.qwen3 import Qwen3Model
    from refengine.parallel.sharding import shard_target

    torch.set_num_threads(1)
    config, rank = args.config, args.rank
    try:
        device = rank_device(config.device, rank)
        full = Qwen3Model.load(
            config.target_path,
            dtype=getattr(torch, config.torch_dtype_name),
            device=device,
            synthetic=config.synthetic_weights,
        )
        model = shard_target(full, rank, config.tensor_parallel_size)
        del full
        c = model.cfg
        pool = KvPool(
            c.num_layers,
            args.num_blocks,
            config.page_size,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            device,
            dummy_blocks=args.dummy_blocks,
        )
        attention = make_backend(config.backend_name, pool, c.num_heads, c.num_kv_heads, c.head_dim)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", None))
    init_group(config, rank, args.store_file)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    model.all_reduce = all_reduce
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break  # rank 0 is gone
            if msg is None:
                break
            ids, positions, slots, q_lens, kv_lens, tables, causal = msg
            batch = AttnBatch(q_lens, kv_lens, tables, slots.to(device), positions.to(device), causal)
            with torch.inference_mode():
                model.forward(ids.to(device), batch, pool, attention)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
