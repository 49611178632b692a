"""Prometheus text exposition (format 0.0.4) of the engine loop's latest snapshot (refengine/server/loop.py),
rendered by prometheus_client (which escapes label values: a served model name may hold quotes, backslashes
or newlines)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

TIMING_KEYS = ("draft_s", "verify_s", "prefill_s", "decode_s")  # Engine runner timings exported as counters
CONTENT_TYPE = CONTENT_TYPE_LATEST


class SnapshotCollector:
    """A prometheus_client collector reading a snapshot dict from `get()` at every scrape."""

    def __init__(self, get: Any, model: str):
        self.get, self.model = get, model

    def collect(self) -> Iterator[Metric]:
        s: dict[str, Any] = self.get()
        m = self.model

        def one(family: type, name: str, help_: str, value: float) -> Metric:
            f = family(f"refengine_{name}", help_, labels=["model"])
            f.add_metric([m], value)
            return f

        yield one(GaugeMetricFamily, "requests_running", "Requests in the running batch.", s["running"])
        yield one(GaugeMetricFamily, "requests_waiting", "Requests waiting for admission.", s["waiting"])
        yield one(GaugeMetricFamily, "kv_blocks_used", "KV cache blocks allocated.", s["kv_blocks_used"])
        yield one(GaugeMetricFamily, "kv_blocks_free", "KV cache blocks free.", s["kv_blocks_free"])
        yield one(GaugeMetricFamily, "kv_blocks_total", "KV cache blocks in the pool.", s["kv_blocks_total"])
        yield one(GaugeMetricFamily, "speculative", "1 when a DFlash drafter speculates.", int(s["speculative"]))
        yield one(GaugeMetricFamily, "spec_tau", "Tokens committed per verify step, over finished requests.", s["tau"])
        yield one(CounterMetricFamily, "spec_verify_steps", "Verify steps of finished requests.", s["verify_steps"])
        hist = s["accepted_hist"]
        buckets, cum = [], 0
        for length in sorted(hist):
            cum += hist[length]
            buckets.append((str(length), cum))
        buckets.append(("+Inf", cum))
        h = HistogramMetricFamily(
            "refengine_spec_accepted_length",
            "Committed length (accepted drafts + 1) per verify step.",
            labels=["model"],
        )
        h.add_metric([m], buckets, sum_value=s["committed_tokens"])
        yield h
        span = s.get("span", {})
        spans = CounterMetricFamily(
            "refengine_spec_span_steps",
            f"Request-steps per verify span chosen by the span policy ({span.get('policy', 'off')}); "
            "span 1: a drafting request decoded plainly.",
            labels=["model", "span"],
        )
        for k, n in sorted(span.get("spans", {}).items(), key=lambda kv: int(kv[0])):
            spans.add_metric([m, str(k)], n)
        yield spans
        policy = GaugeMetricFamily(
            "refengine_spec_span_policy",
            "1 for the span policy choosing verify spans (fixed: the drafter's block, cut to a request's budget; "
            "adaptive: per step; off: no drafter).",
            labels=["model", "policy"],
        )
        policy.add_metric([m, str(span.get("policy", "off"))], 1)
        yield policy
        yield one(
            CounterMetricFamily,
            "spec_policy_errors",
            "Span choices that raised (those steps decoded plainly).",
            span.get("errors", 0),
        )
        t = s["timings"]
        for key in TIMING_KEYS:
            yield one(CounterMetricFamily, f"{key[:-2]}_seconds", f"Engine time in {key[:-2]}.", t.get(key, 0.0))
        yield one(CounterMetricFamily, "generation_tokens", "Tokens streamed to requests.", s["tokens_generated"])
        fin = CounterMetricFamily(
            "refengine_requests_finished", "Finished requests by finish reason.", labels=["model", "reason"]
        )
        for r, n in sorted(s["finished"].items()):
            fin.add_metric([m, r], n)
        yield fin
        pc = s.get("prefix_cache", {})
        yield one(
            GaugeMetricFamily, "prefix_cache_enabled", "1 when the prefix cache is on.", int(pc.get("enabled", 0))
        )
        yield one(
            CounterMetricFamily, "prefix_cache_queries", "Requests looked up in the prefix cache.", pc.get("queries", 0)
        )
        yield one(CounterMetricFamily, "prefix_cache_hits", "Requests that took cached blocks.", pc.get("hits", 0))
        yield one(
            CounterMetricFamily, "prefix_cache_query_tokens", "Prompt tokens looked up.", pc.get("query_tokens", 0)
        )
        yield one(
            CounterMetricFamily,
            "prefix_cache_cached_tokens",
            "Prompt tokens served from the prefix cache (not prefilled).",
            pc.get("hit_tokens", 0),
        )
        yield one(
            GaugeMetricFamily,
            "prefix_cache_hit_rate",
            "Cached over looked-up prompt tokens since the start.",
            pc.get("hit_rate", 0.0),
        )
        yield one(
            GaugeMetricFamily, "prefix_cache_blocks", "KV blocks in the prefix cache.", pc.get("cached_blocks", 0)
        )
        yield one(CounterMetricFamily, "prefix_cache_evicted_blocks", "Cached blocks evicted.", pc.get("evicted", 0))
        yield one(GaugeMetricFamily, "requests_outstanding", "Requests submitted and not finished.", s["outstanding"])
        yield one(
            CounterMetricFamily,
            "requests_rejected_busy",
            "Requests refused with 429 (the waiting queue was full).",
            s["rejected_busy"],
        )


def metrics_registry(get: Any, model: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(get, model))
    ProcessCollector(registry=reg)  # process_resident_memory_bytes & co. (Linux /proc; nothing elsewhere)
    return reg


def render_metrics(s: dict[str, Any], model: str) -> str:
    """The exposition text of one snapshot."""
    return generate_latest(metrics_registry(lambda: s, model)).decode()
