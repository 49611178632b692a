"""Tensor parallelism for the target (issue 15): which weights split how (sharding.py), the process group and
the worker processes rank 0 starts (group.py), and the rank>0 loop (worker.py). The drafter, the scheduler and
the DFlash lane live on rank 0 only; every rank holds its shard of the target and its own KV pool."""

from refengine.parallel.group import TensorParallelGroup
from refengine.parallel.sharding import check_tensor_parallel, shard_target

__all__ = ["TensorParallelGroup", "check_tensor_parallel", "shard_target"]
