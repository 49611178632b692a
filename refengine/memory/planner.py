"""KV budget planner: how many pool blocks fit on a device, with or without the DFlash reservation.

The arithmetic is upstream's (pegainfer ``profiled_kv_budget`` + ``kv_budget_from_bytes``):

    requested  = ceil(total * gpu_memory_utilization)
    used       = total - free, read once the target weights are resident (CUDA context, weights, and
                 anything else on the device, other processes included)
    activation = peak increase of one worst-case step, minus the temporary KV it needed to run
    margin     = base margin (150 MiB) + reservation.fixed_bytes            (DFlash fixed bytes go here)
    non_kv     = used + activation + margin
    kv_budget  = requested - non_kv
    effective  = bytes_per_block + reservation.per_token_bytes * page_size (DFlash per-token bytes go here)
    num_blocks = kv_budget // effective, refused below 64 blocks; the pool is allocated at bytes_per_block.

Upstream's table (RTX 5070 Ti, "16 GB", utilisation 0.90, Qwen3-4B + DFlash-b16, decode batch 256), MiB
figures floored as its log prints them:

    DFlash off: margin 150 MiB,  KV budget 4113 MiB, 1828 blocks  (4113 / 2.25 MiB = 1828)
    DFlash on:  margin 2972 MiB, KV budget 1389 MiB,  427 blocks  (1389 / 3.25 MiB = 427.4)

The margin and the blocks follow from the configs alone (150 + 2822.5 MiB; 2.25 and 3.25 MiB per block).
The budget does not: ``used + activation`` is a measurement of that card at that moment. Solving the
two rows back on a 16 GiB total gives target weights (7672.25 MiB, from config.json) plus 2810 MiB for
the off launch and plus 2711 MiB for the on launch: the two launches measured 98.5 +- 1 MiB apart (a
desktop card shares its memory with other processes). No single measurement reproduces both rows; the
tests and ``refengine memory --runtime-overhead-mib`` take each row's own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from refengine.config import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_PAGE_SIZE, ModelConfig
from refengine.errors import KvBudgetError, UnsupportedConfigError
from refengine.memory.reservation import ConfigSource, DFlashMemoryReservation, load_config, target_kv_bytes_per_block

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_KV_MARGIN_BYTES = 150 * MiB  # allocator fragmentation and small unprofiled drift
MIN_KV_BLOCKS = 64  # smallest pool the scheduler can make progress with


def mib(nbytes: int) -> int:
    """Whole MiB, floored, as upstream's log prints them."""
    return nbytes // MiB


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the planner sees it: `free_bytes` read once the target weights are loaded."""

    total_bytes: int
    free_bytes: int
    source: str = "given"  # where the numbers come from, for the printout

    def __post_init__(self) -> None:
        if self.total_bytes <= 0 or not 0 <= self.free_bytes <= self.total_bytes:
            raise UnsupportedConfigError(
                f"device memory total={self.total_bytes} B, free={self.free_bytes} B: "
                "need 0 <= free <= total, total > 0"
            )

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    def after_loading(self, nbytes: int, what: str) -> DeviceMemory:
        """The same device once `nbytes` more are resident (e.g. the target weights, when planning ahead)."""
        if nbytes > self.free_bytes:
            raise KvBudgetError(
                f"{what} needs {mib(nbytes)} MiB but only {mib(self.free_bytes)} MiB of {mib(self.total_bytes)} MiB "
                f"are free ({self.source}): use a larger device or free the memory other processes hold"
            )
        return DeviceMemory(self.total_bytes, self.free_bytes - nbytes, f"{self.source} + {what}")


@dataclass(frozen=True)
class KvBudgetPlan:
    """The outcome of planning, every intermediate kept so a reader can redo the arithmetic."""

    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int  # ceil(total * utilisation)
    used_bytes: int  # resident before the pool: context, target weights, other processes
    activation_peak_bytes: int  # worst-case step's peak increase, temporary KV excluded
    base_margin_bytes: int
    dflash_fixed_bytes: int  # 0 with DFlash off
    margin_bytes: int  # base + DFlash fixed
    non_kv_bytes: int  # used + activation + margin
    kv_budget_bytes: int  # requested - non_kv
    page_size: int
    bytes_per_block: int  # what a pool block really costs (target K/V)
    dflash_bytes_per_token: int  # 0 with DFlash off
    effective_bytes_per_block: int
    num_blocks: int
    max_context_tokens: int
    graph_pool_bytes: int = 0  # CUDA graphs' private pool and buffers (included in activation_peak_bytes)
    outside_torch_bytes: int = 0  # measured plans: device memory held outside torch's caching allocator
    # (CUDA context, other processes); turns torch's reserved peak into a
    # device-level peak and sets the allocator cap

    def __post_init__(self) -> None:
        checks = {
            "margin = base + dflash fixed": self.margin_bytes == self.base_margin_bytes + self.dflash_fixed_bytes,
            "non_kv = used + activation + margin": self.non_kv_bytes
            == self.used_bytes + self.activation_peak_bytes + self.margin_bytes,
            "budget = requested - non_kv": self.kv_budget_bytes == self.requested_bytes - self.non_kv_bytes,
            "effective = block + per_token * page": self.effective_bytes_per_block
            == self.bytes_per_block + self.dflash_bytes_per_token * self.page_size,
            "blocks = budget // effective": self.num_blocks == self.kv_budget_bytes // self.effective_bytes_per_block,
        }
        broken = [name for name, ok in checks.items() if not ok]
        if broken:
            raise ValueError(f"inconsistent KvBudgetPlan ({', '.join(broken)}): {self}")

    @property
    def dflash(self) -> bool:
        return self.dflash_bytes_per_token > 0 or self.dflash_fixed_bytes > 0

    @property
    def pool_bytes(self) -> int:
        """What the pool allocation itself takes (target-only bytes per block)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_full_length_request(self) -> int:
        return math.ceil(self.max_context_tokens / self.page_size)

    @property
    def max_full_length_requests(self) -> int:
        """Requests of max_context_tokens (prompt + max_tokens) the pool holds at once."""
        return self.num_blocks // self.blocks_per_full_length_request

    @property
    def allocator_cap_fraction(self) -> float:
        """The share of the device torch's caching allocator may hold so the process stays within the plan."""
        return min(max((self.requested_bytes - self.outside_torch_bytes) / self.total_bytes, 0.0), 1.0)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            dflash=self.dflash,
            pool_bytes=self.pool_bytes,
            margin_mib=mib(self.margin_bytes),
            kv_budget_mib=mib(self.kv_budget_bytes),
            blocks_per_full_length_request=self.blocks_per_full_length_request,
            max_full_length_requests=self.max_full_length_requests,
        )
        return out


def plan_kv_budget(
    device: DeviceMemory,
    *,
    target_config: ConfigSource | ModelConfig,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    reservation: DFlashMemoryReservation | None = None,
    activation_peak_bytes: int = 0,
    margin_bytes: int = DEFAULT_KV_MARGIN_BYTES,
    page_size: int | None = None,
    dtype_bytes: int = 2,
    max_context_tokens: int | None = None,
    min_blocks: int = MIN_KV_BLOCKS,
    min_full_length_requests: int = 0,
    outside_torch_bytes: int = 0,
    graph_pool_bytes: int = 0,
) -> KvBudgetPlan:
    """Size the KV pool (formula in the module docstring); `reservation=None` plans with DFlash off.

    `device.free_bytes` must be read with the target weights resident, as upstream profiles after loading;
    when planning ahead, use ``device.after_loading(target_weight_bytes(...), ...)``. Raises KvBudgetError,
    naming what to change, when fewer than `min_blocks` blocks or `min_full_length_requests` requests fit.
    """
    target = (
        target_config
        if isinstance(target_config, ModelConfig)
        else ModelConfig.from_hf(load_config(target_config), where="target")
    )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise UnsupportedConfigError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if activation_peak_bytes < 0 or margin_bytes < 0 or min_blocks < 1 or min_full_length_requests < 0:
        raise UnsupportedConfigError(
            "activation_peak_bytes and margin_bytes must be >= 0, min_blocks >= 1, min_full_length_requests >= 0"
        )
    if page_size is None:
        page_size = reservation.page_size if reservation else DEFAULT_PAGE_SIZE
    bytes_per_block = target_kv_bytes_per_block(target, page_size, dtype_bytes)
    context_limit = reservation.max_context_tokens if reservation else target.max_position_embeddings
    if reservation is not None and (reservation.page_size, reservation.target_bytes_per_block) != (
        page_size,
        bytes_per_block,
    ):
        raise UnsupportedConfigError(
            f"reservation was built for page {reservation.page_size} / {reservation.target_bytes_per_block} B per "
            f"block, the plan uses page {page_size} / {bytes_per_block} B: build both from the same target and page"
        )
    if max_context_tokens is None:
        max_context_tokens = context_limit
    if not 0 < max_context_tokens <= context_limit:
        raise UnsupportedConfigError(
            f"max_context_tokens={max_context_tokens} must be in 1..{context_limit} "
            f"(the model's limit{' with DFlash on' if reservation else ''})"
        )

    requested = math.ceil(device.total_bytes * gpu_memory_utilization)
    fixed = reservation.fixed_bytes if reservation else 0
    per_token = reservation.per_token_bytes if reservation else 0
    margin = margin_bytes + fixed
    non_kv = device.used_bytes + activation_peak_bytes + margin
    effective = bytes_per_block + per_token * page_size
    budget = requested - non_kv
    affordable = max(budget, 0) // effective
    plan_numbers = (
        f"requested {mib(requested)} MiB ({gpu_memory_utilization:.2f} x {mib(device.total_bytes)} MiB"
        f", {device.source}) - used {mib(device.used_bytes)} - activation {mib(activation_peak_bytes)}"
        f" - margin {mib(margin)} (base {mib(margin_bytes)} + DFlash fixed {mib(fixed)})"
        f" = KV budget {budget // MiB} MiB at {effective} B per block"
    )
    if affordable < min_blocks:
        raise KvBudgetError(
            f"KV pool affords {affordable} blocks, below the {min_blocks}-block minimum: "
            f"{plan_numbers}. {_advice(gpu_memory_utilization, reservation, None)}"
        )
    plan = KvBudgetPlan(
        total_bytes=device.total_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes=requested,
        used_bytes=device.used_bytes,
        activation_peak_bytes=activation_peak_bytes,
        base_margin_bytes=margin_bytes,
        dflash_fixed_bytes=fixed,
        margin_bytes=margin,
        non_kv_bytes=non_kv,
        kv_budget_bytes=budget,
        page_size=page_size,
        bytes_per_block=bytes_per_block,
        dflash_bytes_per_token=per_token,
        effective_bytes_per_block=effective,
        num_blocks=affordable,
        max_context_tokens=max_context_tokens,
        outside_torch_bytes=outside_torch_bytes,
        graph_pool_bytes=graph_pool_bytes,
    )
    if plan.max_full_length_requests < min_full_length_requests:
        raise KvBudgetError(
            f"KV pool of {plan.num_blocks} blocks holds {plan.max_full_length_requests} requests of "
            f"{max_context_tokens} tokens ({plan.blocks_per_full_length_request} blocks each), "
            f"{min_full_length_requests} wanted: {plan_numbers}. "
            f"{_advice(gpu_memory_utilization, reservation, max_context_tokens)}"
        )
    return plan


def _advice(utilization: float, reservation: DFlashMemoryReservation | None, context: int | None) -> str:
    """What the user can change, most effective first."""
    tips = []
    if reservation is not None:
        scratch = (
            reservation.batch_dense_scratch_bytes
            + reservation.batch_logits_scratch_bytes
            + reservation.block_headroom_bytes
        )
        if scratch:
            tips.append(
                f"lower the max decode batch (now {reservation.max_decode_batch}; the drafter's batch scratch "
                f"and headroom take {mib(scratch)} MiB of the margin and scale with it)"
            )
        if reservation.accounting == "upstream":
            tips.append("use the lane accounting (accounting='lane', --accounting lane: bills the lane's real scratch)")
    if utilization < 0.99:
        tips.append(f"raise the gpu memory utilisation (now {utilization:.2f})")
    if context is not None:  # only helps when full-length requests are what does not fit
        tips.append(f"use a shorter max context (now {context} tokens)")
    tips.append("free memory other processes hold, or use a larger device")
    if reservation is not None:
        tips.append("turn DFlash off")
    return "To fit: " + "; ".join(tips) + "."
