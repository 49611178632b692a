"""HF transformers as the distribution gate's oracle: the target's processed conditional at every sampled
position of an engine's continuations (ConditionalRecords), and a plain seeded HF sampler (SampleRecords
drawn exactly from the oracle, for a baseline and for the gate's own tests).

torch / transformers are imported lazily (through golden.hf_reference) so that golden.distribution and
the gate CLI stay numpy-only. Logits are taken in fp32 (float64 for the processing) from one
teacher-forced forward per record, batch 1, eager attention, like every other HF golden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from golden.distribution.processing import SamplingConfig, cdf_step, process_logits
from golden.distribution.records import ConditionalRecord, SampleRecord
from golden.distribution.speculative import sample_inverse_cdf


def hf_conditionals(
    model_dir: str | Path, samples: Sequence[SampleRecord], cfg: SamplingConfig, dtype=None, device: str = "cpu"
) -> list[ConditionalRecord]:
    """For each sample, (cdf_below, prob) of each output token under the target's processed conditional."""
    import torch

    from golden.hf_reference import target_forward

    out = []
    for s in samples:
        logits, _ = target_forward(model_dir, s.ids, [0], dtype or torch.float32, device)
        rows = logits[len(s.prompt_ids) - 1 : len(s.ids) - 1].double().cpu().numpy()  # row i predicts output[i]
        steps = [cdf_step(process_logits(row, cfg), x) for row, x in zip(rows, s.output_ids)]
        out.append(
            ConditionalRecord(
                name=s.name,
                prompt_ids=list(s.prompt_ids),
                output_ids=list(s.output_ids),
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                cdf_below=[c for c, _ in steps],
                prob=[p for _, p in steps],
            )
        )
    return out


def hf_sample(
    model_dir: str | Path,
    prompts: Mapping[str, Sequence[int]],
    cfg: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    dtype=None,
    device: str = "cpu",
) -> list[SampleRecord]:
    """Plain ancestral sampling from the target (one full forward per token: slow, for tiny models): each
    prompt's tokens drawn by inverse CDF from process_logits with numpy's default_rng([seed, index])."""
    import torch

    from golden.hf_reference import target_forward

    records = []
    for index, (name, prompt) in enumerate(prompts.items()):
        rng = np.random.default_rng([seed, index])
        ids = list(prompt)
        for _ in range(max_new_tokens):
            logits, _ = target_forward(model_dir, ids, [0], dtype or torch.float32, device)
            ids.append(sample_inverse_cdf(process_logits(logits[-1].double().cpu().numpy(), cfg), rng.random()))
        records.append(SampleRecord(name=name, prompt_ids=list(prompt), output_ids=ids[len(prompt) :], seed=seed))
    return records
