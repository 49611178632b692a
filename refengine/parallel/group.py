"""Rank 0's side of tensor parallelism: start one process per extra rank, set up the process group (gloo on
the CPU, NCCL on CUDA) with a timeout, send each forward's inputs to the workers, all-reduce, tear down.

Control plane: rank 0 (the calling process, which runs the scheduler, the allocator and the DFlash lane)
sends each forward's inputs (token ids, positions, slots, the attention batch's q_lens / kv_lens / block
tables and causal flag) to every worker over a pipe, the way vLLM's shared-memory broadcast queue does; the
data plane (the all-reduces inside the forward) is torch.distributed. A pipe, unlike a collective, has no
timeout to hit while the engine sits idle; collectives run only inside a forward, under the group timeout.

Failure: a worker found dead before a forward, a pipe that breaks, or an all-reduce that fails or times out
(EngineConfig.tensor_parallel_timeout_s) raises TensorParallelError naming the rank; the group stays failed
(every later call raises the same error) until close(), which stops the workers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refengine.attention.base import AttnBatch
from refengine.config import EngineConfig
from refengine.errors import TensorParallelError, UnsupportedConfigError
from refengine.parallel.worker import WorkerArgs, init_group, worker_main

STARTUP_TIMEOUT_S = 300.0


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, num_blocks: int, dummy_blocks: int):
        """Start ranks 1..tp-1 (each loads and shards the target and allocates its pool of `num_blocks`
        blocks), wait until they are ready, and join the process group as rank 0."""
        self.tp = config.tensor_parallel_size
        self.timeout_s = config.tensor_parallel_timeout_s
        self.failed: TensorParallelError | None = None
        self.closed = False
        self.procs: list = []
        self.conns: list = []
        self._joined = False
        if dist.is_available() and dist.is_initialized():
            raise UnsupportedConfigError(
                "tensor_parallel_size > 1: torch.distributed's default process group is already initialised in "
                "this process (another tensor-parallel engine still open?): close it first (Engine.close())"
            )
        self._dir = tempfile.mkdtemp(prefix="refengine-tp-")
        store_file = os.path.join(self._dir, "store")
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, self.tp):
                parent, child = ctx.Pipe()
                args = WorkerArgs(config, rank, store_file, num_blocks, dummy_blocks)
                p = ctx.Process(target=worker_main, args=(args, child), daemon=True, name=f"refengine-tp-rank{rank}")
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._wait_ready()
            init_group(config, 0, store_file)
            self._joined = True
        except TensorParallelError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise TensorParallelError(
                f"tensor-parallel setup over {self.tp} ranks failed: {type(e).__name__}: {e}"
            ) from e

    def _wait_ready(self) -> None:
        # start-up (spawn, import torch, load the checkpoint) is slower than a collective: bounded separately,
        # by the group timeout or STARTUP_TIMEOUT_S, whichever is longer; a worker that exits is seen at once
        limit = max(self.timeout_s, STARTUP_TIMEOUT_S)
        deadline = time.monotonic() + limit
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            rank = i + 1
            while not conn.poll(0.05):
                if not p.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited during setup (code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} not ready after {limit:g} s (loading its shard)"
                    )
            kind, detail = conn.recv()
            if kind != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load its shard: {detail}")

    # ---- per forward ----------------------------------------------------------------------------------------
    def _fail(self, what: str) -> TensorParallelError:
        dead = [
            f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()
        ]
        msg = f"tensor parallel ({self.tp} ranks): {what}"
        if dead:
            msg += f"; dead: {', '.join(dead)}"
        self.failed = TensorParallelError(
            msg + "; the engine cannot serve any more: close it (Engine.close()) and start a new one"
        )
        return self.failed

    def check(self) -> None:
        """Raise if the group failed or closed, or a worker died."""
        if self.failed is not None:
            raise self.failed
        if self.closed:
            raise TensorParallelError("tensor parallel: the engine was closed")
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                raise self._fail(f"rank {i + 1} died")

    def send_forward(self, ids: torch.Tensor, batch: AttnBatch) -> None:
        """Hand every worker the inputs of the forward rank 0 is about to run."""
        self.check()
        msg = (
            ids.cpu(),
            batch.positions.cpu(),
            batch.slots.cpu(),
            list(batch.q_lens),
            list(batch.kv_lens),
            [list(t) for t in batch.block_tables],
            batch.causal,
        )
        for i, conn in enumerate(self.conns):
            try:
                conn.send(msg)
            except (OSError, EOFError) as e:
                raise self._fail(f"sending the forward to rank {i + 1} failed ({type(e).__name__}: {e})") from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place; a failure or a timeout is a TensorParallelError."""
        if self.failed is not None:
            raise self.failed
        try:
            dist.all_reduce(t)
        except Exception as e:
            raise self._fail(
                f"all_reduce failed or timed out (timeout {self.timeout_s:g} s): {type(e).__name__}: {e}"
            ) from e
        return t

    # ---- teardown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (asked nicely, then terminated, then killed) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5 if self.failed is None else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for conn in self.conns:
            conn.close()
        if self._joined and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)
