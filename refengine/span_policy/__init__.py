"""Span policies: how many tokens each drafting request verifies per step (refengine/span_policy/base.py).
`fixed` (FixedSpans, the default) and `adaptive` (GoodputSpans); EngineConfig(speculation=...) picks one."""

from refengine.span_policy.base import SPAN_POLICIES, ShapeCost, SpanPolicy, StepReport, StepShapes, build_span_policy

__all__ = ["SPAN_POLICIES", "ShapeCost", "SpanPolicy", "StepReport", "StepShapes", "build_span_policy"]
