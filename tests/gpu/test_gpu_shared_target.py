"""An engine on another engine's loaded target on CUDA (the paired bench's shared weights; bf16, marked `gpu`):
EngineConfig(device="cuda") loads onto cuda:0, so a target there is the config's model, and the two engines
decode the same tokens. The CPU versions: tests/unit/test_shared_target.py.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_shared_target.py
"""

from __future__ import annotations

import pytest

from refengine.request import SamplingParams
from tests.adapter import gpu_engine

pytestmark = pytest.mark.gpu


def test_a_shared_target_on_cuda_is_accepted_for_the_device_cuda(trained_pair):
    own = gpu_engine(trained_pair.target)
    shared = gpu_engine(trained_pair.target, shared_target=own.target)
    assert shared.target is own.target
    params = SamplingParams(max_tokens=8)
    a = [r.output_ids for r in own.generate([[3, 17, 42]], params)]
    b = [r.output_ids for r in shared.generate([[3, 17, 42]], params)]
    assert a == b, f"{a} vs {b}"
