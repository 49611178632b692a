"""Speculative decoding: greedy acceptance (accept.py), the Proposer seam (proposer.py), the DFlash lane
(lane.py)."""

from refengine.spec_decode.accept import VerifyResult, accept_greedy, build_verify_results
from refengine.spec_decode.proposer import DraftItem, Proposer

__all__ = ["DraftItem", "Proposer", "VerifyResult", "accept_greedy", "build_verify_results"]
