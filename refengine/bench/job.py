"""What one measurement process needs to know (`ModeJob`, pickled to a fresh process on CUDA), and how a cell's
requests arrive (`--arrivals`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from refengine.bench.prompts import make_prompts
from refengine.spec_decode.acceptance_profile import AcceptanceProfile, parse_profile

# --arrivals: `wave`, a cell's c requests submitted together and run to the last (the default); `steady`,
# STEADY_ROUNDS x c requests, c of them in flight, the next submitted as one finishes (a server at constant
# concurrency: arrivals meet requests mid-generation, and no cell ends on one wave's tail; the first c's budgets
# spread out, steady_budgets)
ARRIVALS = ("wave", "steady")
STEADY_ROUNDS = 4


def steady_budgets(requests: int, in_flight: int, output_tokens: int) -> list[int]:
    """Each request's token budget under steady arrivals: the first `in_flight` spread evenly over (0,
    output_tokens], the rest output_tokens each. As if the server had been running at constant concurrency,
    its requests in flight at evenly spread stages: every mode's finishes and arrivals then spread out, plain
    decode's too. With equal budgets plain decode's requests finished together and its steady cells re-ran
    waves (one prefill a wave) while speculation's spread out (a prefill an arrival): on the H200 at c32
    adaptive's prefills took 895 ms a run against plain's 211 (docs/PERF.md)."""
    first = [math.ceil(output_tokens * (i + 1) / in_flight) for i in range(min(in_flight, requests))]
    return first + [output_tokens] * (requests - len(first))


@dataclass(frozen=True)
class ModeJob:
    """What one mode's measurement needs (pickled to a fresh process on CUDA); bench() validates the inputs."""

    target: str
    draft: str | None
    device: str
    synthetic: bool
    concurrency: tuple[int, ...]
    prompt_len: int
    output_tokens: int
    repeats: int
    profiles: tuple[str, ...]
    prompts: str
    context: int  # the engine's max_model_len
    blocks: int  # its KV pool
    seed: int
    profile_ops: bool
    graph_mode: str | None
    settle_s: float
    bandwidth: float  # measured copy bandwidth, bytes/s: the floors
    share_weights: bool = True  # paired: the engines of a process read one copy of the target's weights
    arrivals: str = "wave"  # ARRIVALS
    temperature: float = 0.0  # > 0: the measured runs sample (request i seeded i)
    draft_sampling: str = "sampled"  # EngineConfig.draft_sampling: how they draft then
    fused_ops: tuple[str, ...] | None = None  # EngineConfig.fused_ops (None: the default kernels)

    def cell_prompts(self, c: int, vocab: int) -> tuple[list[list[int]], int | None]:
        """A cell's prompts and how many run at once (None: all, a wave)."""
        if self.arrivals == "steady":
            return make_prompts(self.prompts, c * STEADY_ROUNDS, self.prompt_len, vocab, self.target, self.seed), c
        return make_prompts(self.prompts, c, self.prompt_len, vocab, self.target, self.seed), None


def job_profiles(j: ModeJob) -> list[AcceptanceProfile | None]:
    """The job's acceptance profiles in order ([None]: the drafter's own acceptance)."""
    return [parse_profile(p) for p in j.profiles] or [None]


def job_own_bytes(facts: dict[str, Any]) -> int:
    """Target plus drafter weight bytes (DFlash's own memory-bound ideal)."""
    return int(facts["target_weight_bytes"] + facts.get("drafter_weight_bytes", 0))
