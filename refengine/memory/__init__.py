"""Memory: the DFlash reservation (reservation.py), the KV budget planner (planner.py, pure arithmetic),
device readings (device.py), the GPU profile that feeds the planner (profile.py) and `refengine memory`
(cli.py). Imports run one way: reservation <- planner <- device <- profile; cli uses the first three."""

from refengine.memory.planner import DeviceMemory, KvBudgetPlan, plan_kv_budget
from refengine.memory.reservation import DFlashMemoryReservation, target_kv_bytes_per_block, target_weight_bytes

__all__ = [
    "DFlashMemoryReservation",
    "DeviceMemory",
    "KvBudgetPlan",
    "plan_kv_budget",
    "target_kv_bytes_per_block",
    "target_weight_bytes",
]
