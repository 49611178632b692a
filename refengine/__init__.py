"""refengine: a compact reference engine for DFlash speculative decoding on Qwen3."""

from refengine.config import EngineConfig
from refengine.engine import Engine
from refengine.request import FinishReason, Request, RequestStatus, SamplingParams

__all__ = ["Engine", "EngineConfig", "FinishReason", "Request", "RequestStatus", "SamplingParams"]
__version__ = "0.1.0"
