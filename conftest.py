"""Shared pytest setup: markers, offline mode, and the model pairs every golden/lossless test runs on.

Model pairs: the tiny random pair always; the trained tiny pair when its files exist; a real pair
(e.g. Qwen3-4B + z-lab/Qwen3-4B-DFlash-b16) when REFENGINE_TARGET_PATH and REFENGINE_DRAFT_PATH are set.
The drafter differential test also runs on tiny-random-gqa2 (2 KV heads, MASK id mid-vocabulary).
CPU tests run in fp32; tests marked `gpu` run in bf16 on CUDA and skip cleanly without it. Every Engine.step
in the suite is followed by Engine.check_integrity() (an autouse fixture).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.servers"
]  # spec_server / plain_server: the served tiny pair (tests/serve, the conformance tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before CUDA initialises: growable segments keep the caching allocator's reserved memory close to what is
# allocated, so a planned KV budget is not eaten by fragmentation (the memory test holds the device peak to it).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT / "fixtures"


@dataclass(frozen=True)
class ModelPair:
    name: str
    target: Path
    draft: Path
    golden: Path | None  # stored golden data dir, when this pair has one

    @property
    def has_tokenizer(self) -> bool:
        return (self.target / "tokenizer.json").is_file()


def model_pairs() -> list[ModelPair]:
    pairs = []
    for name in ("tiny-random", "tiny-trained"):
        d = FIXTURES / name
        if (d / "target" / "config.json").is_file() and (d / "draft" / "config.json").is_file():
            g = ROOT / "golden" / "data" / name
            pairs.append(ModelPair(name, d / "target", d / "draft", g if (g / "manifest.json").is_file() else None))
    t, d = os.environ.get("REFENGINE_TARGET_PATH"), os.environ.get("REFENGINE_DRAFT_PATH")
    if t and d:
        pairs.append(ModelPair("real", Path(t), Path(d), None))
    return pairs


def pytest_configure(config):
    import torch

    # One intra-op thread: tiny fp32 matmuls gain nothing from more, and on a 2-core box shared by xdist
    # workers, oversubscribed OpenMP threads make them ~100x slower.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=model_pairs(), ids=lambda p: p.name)
def model_pair(request) -> ModelPair:
    return request.param


@pytest.fixture
def pair_copy(tmp_path, random_pair):
    """A writable copy of the tiny random pair (target dir, draft dir), for tests that corrupt a checkpoint."""
    t, d = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(random_pair.target, t)
    shutil.copytree(random_pair.draft, d)
    return t, d


@pytest.fixture(scope="session")
def random_pair() -> ModelPair:
    return next(p for p in model_pairs() if p.name == "tiny-random")


@pytest.fixture(scope="session")
def trained_pair() -> ModelPair:
    """The trained tiny pair (real acceptance: drafts get accepted, so verify rows past the first matter)."""
    pair = next((p for p in model_pairs() if p.name == "tiny-trained"), None)
    if pair is None:
        pytest.fail("fixtures/tiny-trained is missing (python -m fixtures.build.train_target / train_draft)")
    return pair


@pytest.fixture(autouse=True)
def _integrity_after_every_step(monkeypatch):
    """Every Engine.step in the suite is followed by Engine.check_integrity(): scheduler, KV pool and proposer
    agree after every step of every test (IntegrityError at the first step where they do not)."""
    from refengine.engine import Engine

    step = Engine.step

    def checked_step(self):
        done = step(self)
        self.check_integrity()
        return done

    monkeypatch.setattr(Engine, "step", checked_step)


def gqa_pair() -> ModelPair | None:
    """A third tiny random pair for the drafter differential test only (not in model_pairs(), so the
    model_pair-parametrized tests do not run on it): 2 KV heads and the drafter's MASK id mid-vocabulary."""
    d = FIXTURES / "tiny-random-gqa2"
    if (d / "target" / "config.json").is_file() and (d / "draft" / "config.json").is_file():
        return ModelPair("tiny-random-gqa2", d / "target", d / "draft", None)
    return None


@pytest.fixture(params=model_pairs() + [p for p in (gqa_pair(),) if p is not None], ids=lambda p: p.name)
def differential_pair(request) -> ModelPair:
    """model_pairs() plus the GQA / mid-vocabulary-MASK pair: for the drafter-vs-oracle differential test."""
    return request.param
