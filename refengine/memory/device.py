"""Device readings for the planner: real free/total memory, and the activation peak of one profiled step.
CUDA-only and imported lazily, so the planner and the `refengine memory` CLI run without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from refengine.memory.planner import DeviceMemory, mib


@dataclass(frozen=True)
class ActivationPeak:
    """One profiled step: how far the CUDA caching allocator rose above where it started."""

    baseline_allocated_bytes: int
    peak_allocated_bytes: int
    baseline_reserved_bytes: int
    peak_reserved_bytes: int
    temporary_kv_bytes: int  # a KV buffer allocated only so the dummy step is legal; not activation

    @property
    def non_kv_peak_increase_bytes(self) -> int:
        # The device sees what the allocator reserved, which is at least what was allocated.
        rise = max(
            self.peak_allocated_bytes - self.baseline_allocated_bytes,
            self.peak_reserved_bytes - self.baseline_reserved_bytes,
        )
        return max(rise - self.temporary_kv_bytes, 0)


def profile_activation_peak(
    step: Callable[[], object], device: str = "cuda", *, temporary_kv_bytes: int = 0
) -> ActivationPeak:
    """Run one worst-case step (e.g. a max prefill chunk plus max_decode_batch - 1 decode rows) and measure it."""
    import torch  # lazily: the planner itself runs without torch.cuda

    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base_alloc, base_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    step()
    torch.cuda.synchronize(dev)
    return ActivationPeak(
        base_alloc,
        torch.cuda.max_memory_allocated(dev),
        base_reserved,
        torch.cuda.max_memory_reserved(dev),
        temporary_kv_bytes,
    )


def read_device_memory(device: str = "cuda") -> DeviceMemory:
    """Real total / free memory: torch.cuda.mem_get_info (what this process can allocate), named through
    nvidia-ml-py when it is installed. Both imported lazily so CPU-only installs never need them."""
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    source = f"cuda:{index} {torch.cuda.get_device_name(index)}"
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            # By PCI address: nvml's indices ignore CUDA_VISIBLE_DEVICES, torch's do not.
            props = torch.cuda.get_device_properties(index)
            pci = "{:08X}:{:02X}:{:02X}.0".format(
                *(getattr(props, f"pci_{part}_id") for part in ("domain", "bus", "device"))
            )  # untyped in torch's stubs
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            source += f" (nvml: total {mib(info.total)} MiB, used {mib(info.used)} MiB)"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # nvml is a cross-check only; torch's numbers are the ones planned with
        source += f" (nvml unavailable: {type(e).__name__})"
    return DeviceMemory(total_bytes=int(total), free_bytes=int(free), source=source)
