"""Shadow probes: adaptive speculation's probes without a verify.

A probe (a first-step probe, a re-probe, a follow-up: exploration.py) only measures how many of a request's
drafts the target would accept. When the choice is otherwise plain, the scheduler makes it a shadow: the step
decodes plainly (every request one token, its taps captured), and the probed requests' drafter drafts their
block at the same position, on a second CUDA stream while the decode graph runs (runner/shadow_drafts.py).
Greedy decoding commits the target's argmax at every position whatever the spans, so the tokens decoded next
are exactly those a verify of that block would have scored: the longest prefix of the drafts that matches
them is the verify's accepted count m. The answer arrives as the tokens do: at the first mismatch, or after
span - 1 matches (at tau 1, on the step that launched it). Until then the request is `in_flight` for the
policy (no new probe, no retirement). A request that finishes first reports the positions it compared.

Why: a probe's verify step cost ~2.2 ms over the decode step it replaced at c1 on Qwen3-4B shapes (H200, run
68: the draft, the wider verify, the planning of both), which is most of what adaptive loses to plain where
drafts are never accepted. Side by side on the H200 (run 85, graph replays only), a draft graph on a second
stream adds 0.39 / 0.52 / 1.42 ms to the decode step at batch 1 / 8 / 32 (the draft and a 2-row verify after
it: +0.84 / +1.04 / +1.92), and 0.01-0.07 ms on the trained tiny pair (+0.14-0.22); its host work runs while
the decode graph does.

Under an acceptance profile (refengine bench only) outputs are not greedy-exact, so m is drawn from the
profile for the shadow's span as a verify's would be, and reported at once.

Opt-in (EngineConfig.shadow_probes): measured on the H200 in the same runs against verifying probes (run
87, docs/PERF.md), the shadow step cost 4.9 ms against the verify's 6.1 (a 4.1 ms decode step) at c1 on
Qwen3-4B shapes, but whole runs at tau 1 / 1.3 came out -1.7% to +1.5% (c1 worse, c8-c32 at tau 1 better),
and on the trained tiny pair c1 rose from 1.97 to 2.77x plain while c32 fell from 0.94 to 0.85x: the
acceptance the shadows found made adaptive speculate where fixed DFlash loses.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.spec_decode.span_choice import Decision


@dataclass
class OpenShadow:
    first: int  # index into the request's output_ids of the token d_1 predicts
    drafts: list[int]  # d_1 .. d_{span-1}
    span: int


class ShadowProbes:
    """Shadow probes awaiting their answer, by request id."""

    def __init__(self) -> None:
        self.open: dict[int, OpenShadow] = {}

    def start(self, req_id: int, first: int, drafts: list[int], span: int) -> None:
        if len(drafts) != span - 1 or span < 2:
            raise ValueError(f"request {req_id}: a shadow probe of span {span} with {len(drafts)} drafts")
        self.open[req_id] = OpenShadow(first, list(drafts), span)

    def settle(self, req_id: int, output_ids: list[int], finished: bool) -> tuple[int, int] | None:
        """(span, accepted) once the request's tokens decide it (the shadow closes), else None. A request that
        finished before its last draft was compared reports what was: (compared + 1, compared) when all of
        those matched (nothing compared: no answer, closed)."""
        o = self.open.get(req_id)
        if o is None:
            return None
        got = output_ids[o.first : o.first + len(o.drafts)]
        m = 0
        for d, t in zip(o.drafts, got):
            if d != t:
                break
            m += 1
        if m < len(got) or m == len(o.drafts):  # a mismatch, or every draft matched
            del self.open[req_id]
            return o.span, m
        if finished:
            del self.open[req_id]
            return (m + 1, m) if m else None
        return None

    def release(self, req_id: int) -> None:
        self.open.pop(req_id, None)


class ShadowChoice:
    """The policy's side of shadow probes (a mixin of AdaptivePolicy, refengine/spec_decode/adaptive.py)."""

    # what AdaptivePolicy provides
    probed: list[int]
    last: Decision | None
    in_flight: set[int]
    shadows: int

    def observe_acceptance(self, req_id: int, span: int, accepted: int) -> None:
        raise NotImplementedError

    def shadowable(self, spans: list[int]) -> list[int]:
        """Indices of the requests a plain choice probes (`spans`: the choice's): the probes can be shadows,
        drafted while the step decodes plainly (shadow_probe.py). Empty when anything else drafts."""
        probed = self.probed
        if not probed or self.last is None or self.last.cap > 1:
            return []
        ours = set(probed)
        return probed if all(s == 1 for i, s in enumerate(spans) if i not in ours) else []

    def shadows_launched(self, req_ids: list[int]) -> None:
        """Their probes draft as shadows: no new probe or retirement for them until the answer is in."""
        self.in_flight.update(req_ids)
        self.shadows += len(req_ids)

    def observe_shadow(self, req_id: int, span: int, accepted: int) -> None:
        """A shadow probe's answer: what a verify of `span` would have accepted (shadow_probe.py)."""
        self.in_flight.discard(req_id)
        self.observe_acceptance(req_id, span, accepted)
