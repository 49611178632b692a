"""The adaptive policy's visible statistics (AdaptivePolicy.summary): its decision counters, the fitted cost
models, the acceptance estimates and the cost table, as the bench JSON and engine stats show them (ms)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.spec_decode.adaptive import AdaptivePolicy


def _table_order(item: tuple) -> tuple:
    """A cost table's keys in order: a bucket (int) before its (bucket, ...) tuples (the draft table holds
    both: the full block's shape and narrower score caps')."""
    key = item[0]
    return key if isinstance(key, tuple) else (key,)


def policy_summary(policy: AdaptivePolicy) -> dict:
    """The policy's inputs and decisions, for stats / bench JSON (times in ms)."""
    v, d, p = ([t * 1e-3 for t in m.theta] for m in (policy.cost.verify, policy.cost.draft, policy.cost.plain))
    return {
        "decisions": policy.steps - policy._decisions_before,
        "errors": policy.errors,  # choices or preparations that raised (a bug; the bench fails on any)
        "explored": policy.explored,
        "searched": policy.searched,
        "prepared": policy.prepared,  # choices that took the search prepared while the step before ran
        "probes": policy.probes,
        "reprobes": policy.reprobes,
        "shadows": policy.shadows,  # probes drafted while their step decoded plainly (shadow_probe.py)
        "unprobed": policy.unprobed,
        "retired": policy.retirements,
        "retired_by": dict(sorted(policy.sample.retired_by.items())),  # which rule, at which batch size
        # new requests admitted retired, and probed, while dormant; calm first blocks in a row (dormancy.py)
        "dormant": {
            "admitted": policy.dormancy.admitted,
            "probes": policy.dormancy.probes,
            "calm": list(policy.dormancy.calm),
            "entered": list(policy.dormancy.entered),  # by kind of batch: the price rule no longer asked
            # lone rare blocks in large batches where a probe is dear: doubts opened, confirmed, one open now
            "doubts": {
                "opened": policy.dormancy.doubts[0],
                "confirmed": policy.dormancy.doubts[1],
                "open": policy.dormancy.doubt is not None,
            },
        },
        # closed batches judged against plain decode, lost, admitted retired; bucket -> batches still held
        "wave_guard": policy.guard.summary(),
        # large batches' blocks past the rare count judged with their step's others (a dear probe: retirement.py's
        # _rare_together), and of those the ones that surprised
        "rare_blocks_judged_together": {"blocks": policy.rare_together[0], "surprising": policy.rare_together[1]},
        "explore_interval": policy.interval,
        "explore_regret_ms": round(policy.regret_s * 1e3, 3),
        "probe_regret_ms": round(policy.probe_regret_s * 1e3, 3),
        "catch_ups": policy.catch_ups,
        "catch_up_ms_model": {
            "fixed": round(policy.cost.catch_up.theta[0], 4),
            "per_row_us": round(policy.cost.catch_up.theta[1] * 1e3, 3),
            "fits": policy.cost.catch_up.updates,
        },
        "observed_step_ms": round(policy.elapsed_s * 1e3, 3),
        "chosen_cap_hist": {str(k): v for k, v in sorted(policy.caps.items())},
        "verify_ms_model": {
            "per_step": round(v[0] * 1e3, 4),
            "per_request": round(v[1] * 1e3, 5),
            "per_executed_row": round(v[2] * 1e3, 5),
            "fits": policy.cost.verify.updates,
        },
        "draft_ms_model": {
            "per_step": round(d[0] * 1e3, 4),
            "per_request": round(d[1] * 1e3, 5),
            "fits": policy.cost.draft.updates,
        },
        "draft_over_replay_ms_model": {  # X(bucket): a real draft's time beyond its shape's replay (step_costs.py)
            "per_step": round(policy.cost.draft_extra.theta[0], 4),
            "per_request": round(policy.cost.draft_extra.theta[1], 5),
            "fits": policy.cost.draft_extra.updates,
        },
        "plain_ms_model": {
            "per_step": round(p[0] * 1e3, 4),
            "per_request": round(p[1] * 1e3, 5),
            "fits": policy.cost.plain.updates,
        },
        "last_predicted_tok_per_s": round(policy.last.predicted_tok_per_s, 2) if policy.last else None,
        "last_plain_tok_per_s": round(policy.last.plain_tok_per_s, 2) if policy.last else None,
        "last_mean_expected_tokens_full_span": (
            round(policy.last_mean_expected, 3) if policy.last_mean_expected is not None else None
        ),
        **policy.estimates.summary(),
        "host_ms_model": {  # H_kind(n) = per_step + per_request * n, the host's time a step (step_costs.py)
            kind: {"per_step": round(f.theta[0], 4), "per_request": round(f.theta[1], 5), "fits": f.updates}
            for kind, f in policy.cost.host.items()
        },
        "cost_table_ms": {
            kind: {str(k): round(v * 1e3, 3) for k, v in sorted(table.items(), key=_table_order)}
            for kind, table in policy.cost.tables.items()
        },
    }
