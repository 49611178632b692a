"""The golden suite's library: plain records, HF oracle, gates, a dense DFlash oracle, stored goldens.

Never imports refengine: any engine that writes golden.records JSONL can be gated (docs/GOLDEN.md).
"""
