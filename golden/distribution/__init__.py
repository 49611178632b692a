"""The distribution gate: speculative *sampling* must leave the target's distribution unchanged.

    processing.py   temperature -> top-k -> top-p on logits (HF generate's order), a probability vector
    speculative.py  the reference speculative-sampling step and the exact enumeration that proves it lossless
    stats.py        randomized PIT, Kolmogorov-Smirnov and chi-square tests, the power calculation
    records.py      SampleRecord (engine) and ConditionalRecord (oracle, golden/hf_sampling.py) JSONL
    gate.py         distribution_gate: PIT of every sampled token, coverage enforced (golden check distribution)

Pure numpy: nothing here imports torch, transformers or refengine.
"""
