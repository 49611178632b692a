"""An Engine built on another engine's loaded target (`Engine(..., target=...)`, what the paired bench does so
its engines read one copy of the weights): it reads those very tensors, its outputs equal those of an engine that
loaded its own copy, and a target that is not what the config would load (another checkpoint's geometry, another
dtype) is refused with a message naming both.

Run: python -m pytest tests/unit/test_shared_target.py -q; on CUDA: tests/gpu/test_gpu_shared_target.py
"""

from __future__ import annotations

import pytest

from refengine.config import EngineConfig
from refengine.engine import Engine
from refengine.errors import UnsupportedConfigError
from refengine.request import SamplingParams
from tests.adapter import cpu_engine, first_divergence


def test_an_engine_on_a_shared_target_reads_it_and_decodes_as_its_own(trained_pair):
    own = cpu_engine(trained_pair.target, trained_pair.draft)
    shared = Engine(
        EngineConfig(str(trained_pair.target), draft_path=str(trained_pair.draft), device="cpu"),
        target=own.target,
    )
    assert shared.target is own.target and shared.target.layers[0].q_proj is own.target.layers[0].q_proj
    prompts = [[3, 17, 42, 9, 100, 7], [5, 6, 7, 8]]
    params = SamplingParams(max_tokens=24)
    a = [r.output_ids for r in own.generate(prompts, params)]
    b = [r.output_ids for r in shared.generate(prompts, params)]
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"prompt {i}: first divergent position {first_divergence(x, y)}: {x} vs {y}"


def test_a_shared_target_that_is_not_the_configs_model_is_refused(random_pair, trained_pair):
    other = cpu_engine(random_pair.target)
    with pytest.raises(UnsupportedConfigError, match="shared target"):
        Engine(EngineConfig(str(trained_pair.target), device="cpu"), target=other.target)
    with pytest.raises(UnsupportedConfigError, match="bfloat16"):
        Engine(EngineConfig(str(random_pair.target), device="cpu", dtype="bfloat16"), target=other.target)
