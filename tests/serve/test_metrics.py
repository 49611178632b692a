"""/metrics: the exposition parses with prometheus_client's own parser, label values are escaped (a served
model name holding a quote, a backslash or a newline round-trips), and the span policy's chosen spans are
exported (refengine_spec_span_steps_total per span, refengine_spec_policy_errors_total) for
`--speculation fixed` and `adaptive`; `refengine serve --speculation`, `--draft-sampling` and
`--gpu-memory-utilization` reach EngineConfig.
CPU, fp32, the trained tiny pair.

Run: python -m pytest -q tests/serve/test_metrics.py
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from refengine import SamplingParams
from refengine.cli import build_parser
from refengine.server.loop import EngineLoop
from refengine.server.metrics import render_metrics
from refengine.server.serve import engine_config
from tests.adapter import cpu_engine
from tests.serve.conftest import PAIR, wait_idle

ODD_NAME = 'tiny"x\\y\nz'


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} for every sample of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def spans_of(text: str, model: str) -> dict[str, float]:
    return {
        dict(labels)["span"]: v
        for (name, labels), v in samples(text).items()
        if name == "refengine_spec_span_steps_total" and dict(labels)["model"] == model
    }


def test_label_values_escaped(spec_server):
    text = render_metrics(spec_server.loop.snapshot, ODD_NAME)
    got = samples(text)
    key = ("refengine_kv_blocks_total", (("model", ODD_NAME),))
    assert key in got, f"the model label did not round-trip: {sorted(got)[:5]}"
    assert got[key] == spec_server.loop.snapshot["kv_blocks_total"]


def test_fixed_spans_exported(spec_server):
    urllib.request.urlopen(
        urllib.request.Request(
            spec_server.url + "/v1/completions",
            b'{"prompt": "def f(x):", "max_tokens": 12}',
            {"Content-Type": "application/json"},
        ),
        timeout=60,
    ).read()
    wait_idle(spec_server)
    with urllib.request.urlopen(spec_server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    spans = spans_of(text, "tiny-trained")
    want = spec_server.loop.engine.span_stats()  # the server is idle: the engine is not stepping
    assert want["policy"] == "fixed" and spans == {k: float(v) for k, v in want["spans"].items()}, (spans, want)
    assert max(int(k) for k in spans) > 1, f"no verify span > 1 under the fixed policy: {spans}"
    assert samples(text)[("refengine_spec_policy_errors_total", (("model", "tiny-trained"),))] == 0
    assert samples(text)[("refengine_spec_span_policy", (("model", "tiny-trained"), ("policy", "fixed")))] == 1
    assert "shadow" not in text


def test_adaptive_spans_exported():
    engine = cpu_engine(PAIR / "target", PAIR / "draft", speculation="adaptive")
    loop = EngineLoop(engine)  # not started: the snapshot is published by hand after a direct generate
    engine.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=24))
    loop._publish_snapshot()
    want = engine.span_stats()
    assert want["policy"] == "adaptive" and want["spans"], want
    text = render_metrics(loop.snapshot, "m")
    got = spans_of(text, "m")
    assert got == {k: float(v) for k, v in want["spans"].items()}, f"exported {got} != Engine.span_stats {want}"
    assert samples(text)[("refengine_spec_span_policy", (("model", "m"), ("policy", "adaptive")))] == 1


def test_serve_engine_flags():
    base = ["serve", "--device", "cpu", "--model", str(PAIR / "target")]
    base += ["--dflash-draft-model-path", str(PAIR / "draft")]
    assert engine_config(build_parser().parse_args(base)).speculation == "fixed"
    args = build_parser().parse_args([*base, "--speculation", "adaptive"])
    assert engine_config(args).speculation == "adaptive"
    assert engine_config(args).draft_sampling == "sampled"
    args = build_parser().parse_args([*base, "--draft-sampling", "greedy"])
    assert engine_config(args).draft_sampling == "greedy", engine_config(args)
    default = engine_config(build_parser().parse_args(base)).gpu_memory_utilization
    args = build_parser().parse_args([*base, "--gpu-memory-utilization", "0.4"])
    assert engine_config(args).gpu_memory_utilization == 0.4 != default, engine_config(args)
