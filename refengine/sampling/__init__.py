"""Sampling: logits processing (temperature, top-k, top-p), per-request random streams, inverse-CDF draws.
The speculative accept rule that uses them is refengine/spec_decode/accept_sampled.py."""
