"""Prometheus text exposition (format 0.0.4) of the engine loop's latest snapshot (refengine/server/loop.py)."""

from __future__ import annotations

from typing import Any


def render_metrics(s: dict[str, Any], model: str) -> str:
    lines: list[str] = []
    lab = f'model="{model}"'

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP refengine_{name} {help_}")
        lines.append(f"# TYPE refengine_{name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"refengine_{name}{suffix_labels} {value}")

    metric("requests_running", "gauge", "Requests in the running batch.", [(f"{{{lab}}}", s["running"])])
    metric("requests_waiting", "gauge", "Requests waiting for admission.", [(f"{{{lab}}}", s["waiting"])])
    metric("kv_blocks_used", "gauge", "KV cache blocks allocated.", [(f"{{{lab}}}", s["kv_blocks_used"])])
    metric("kv_blocks_free", "gauge", "KV cache blocks free.", [(f"{{{lab}}}", s["kv_blocks_free"])])
    metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.", [(f"{{{lab}}}", s["kv_blocks_total"])])
    metric("speculative", "gauge", "1 when a DFlash drafter speculates.", [(f"{{{lab}}}", int(s["speculative"]))])
    metric(
        "spec_tau",
        "gauge",
        "Tokens committed per verify step, over finished requests.",
        [(f"{{{lab}}}", round(s["tau"], 6))],
    )
    metric(
        "spec_verify_steps_total", "counter", "Verify steps of finished requests.", [(f"{{{lab}}}", s["verify_steps"])]
    )
    hist = s["accepted_hist"]
    buckets, cum = [], 0
    for length in sorted(hist):
        cum += hist[length]
        buckets.append((f'_bucket{{{lab},le="{length}"}}', cum))
    buckets.append((f'_bucket{{{lab},le="+Inf"}}', cum))
    buckets.append((f"_sum{{{lab}}}", s["committed_tokens"]))
    buckets.append((f"_count{{{lab}}}", s["verify_steps"]))
    metric("spec_accepted_length", "histogram", "Committed length (accepted drafts + 1) per verify step.", buckets)
    t = s["timings"]
    for key in ("draft_s", "verify_s", "prefill_s", "decode_s", "shadow_s"):
        metric(
            f"{key[:-2]}_seconds_total",
            "counter",
            f"Engine time in {key[:-2]}.",
            [(f"{{{lab}}}", round(t.get(key, 0.0), 6))],
        )
    metric(
        "generation_tokens_total", "counter", "Tokens streamed to requests.", [(f"{{{lab}}}", s["tokens_generated"])]
    )
    metric(
        "requests_finished_total",
        "counter",
        "Finished requests by finish reason.",
        [(f'{{{lab},reason="{r}"}}', n) for r, n in sorted(s["finished"].items())] or [(f"{{{lab}}}", 0)],
    )
    return "\n".join(lines) + "\n"
