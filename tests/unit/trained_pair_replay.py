"""The trained tiny pair's bench on the dev CPU: its real acceptance replayed under the H200's step costs.

Greedy decoding commits the same tokens whatever the spans, and the drafter's block from a position depends
only on the committed context, so what a full block accepts at each output position of each bench prompt is a
fixed table, L[prompt][t]. A span-s block drafted there accepts min(s - 1, L[prompt][t]) drafts. With those
tables (`trained_pair_acceptance.json`, made by `python -m tests.unit.trained_pair_replay --write` on the CPU
in fp32: the engine forced to commit one token a step, the benchmark profile tau1, so that every position is
drafted from), the H200's measured step costs of this pair (H200_COSTS) and the bench's paired order (a c32
settle, then each cell's 16-token warm-up and rounds), the adaptive policy runs its real code on the real
pair's acceptance in ~2 s. It reproduced H200 runs 153 and 157 (docs/PERF.md, thirty-second session):
c8 / c16 / c32 after the settle 1.000 / 1.000 / 1.000 of plain (H200 0.994 / 0.988 / 0.998), c1 3.00 (2.80),
fixed full spans at c8 0.817 (0.76-0.87), and with c1 first c8 0.857 (0.905), c16 0.974 (0.978), before the
wave guard (refengine/spec_decode/wave_guard.py); with it 1.000 / 1.000 (H200 run 161: 0.991 / 0.991).

Run the tests: python -m pytest tests/unit/test_trained_pair_replay.py -q
Rewrite the tables (after the pair, the bench prompts or the drafter's forward change): as above (~30 s).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from refengine.runner.shapes import batch_buckets, row_caps
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.step_costs import CostModel
from tests.unit.test_adaptive import _graph_rows as graph_rows  # the GPU verify graphs' executed rows

TABLES = Path(__file__).with_name("trained_pair_acceptance.json")
B = 16
PROMPTS, PROMPT_LEN, SEED, OUTPUT = "mixed", 128, 0, 128  # the bench's defaults (refengine bench --prompts mixed)
SETTLE_WAVES = 40  # the bench's 5 s settle of the adaptive engine on c32 waves (~80 ms each on the H200)

# The tiny pair on the H200 (run 157's adaptive rows: the policy's fits, graph mode full, bf16): verify
# 0.55 ms + 20.5 us a request + 0.26 us a row; draft 0.35 ms + 20 us a drafting request; plain decode 0.47 ms +
# 12.7 us a request; a catch-up 0.368 ms + 0.806 us a context row; host time a step by kind (fixed, a request);
# a prefill 3.4 ms, its tap capture 0.54 ms more, the decode graph with taps 6 us more.
H200_COSTS = CostModel.linear(0.55e-3, 2.05e-5, 2.6e-7, 0.35e-3, 2.0e-5, p0=0.47e-3, p1=1.27e-5)
HOST_S = {"verify": (0.15e-3, 0.033e-3), "plain": (0.05e-3, 0.003e-3), "engine": (0.03e-3, 0.0)}
CATCH_UP_FIXED_S, CATCH_UP_ROW_S = 0.368e-3, 0.806e-6
PREFILL_S, PREFILL_TAPS_S, TAPS_S = 3.4e-3, 0.54e-3, 6e-6


def pair_fingerprint(target: Path, draft: Path, prompts: list[list[int]]) -> dict[str, str]:
    """What the tables were made from: the pair's weights and the bench prompts (stale tables fail the test)."""
    digest = lambda b: hashlib.sha256(b).hexdigest()[:16]  # noqa: E731
    return {
        "target": digest((target / "model.safetensors").read_bytes()),
        "draft": digest((draft / "model.safetensors").read_bytes()),
        "prompts": digest(json.dumps(prompts).encode()),
    }


def bench_prompts(target: Path, n: int = 32) -> list[list[int]]:
    from refengine.bench.prompts import make_prompts

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return make_prompts(PROMPTS, n, PROMPT_LEN, vocab, target, SEED)


def write_tables() -> None:
    """Draft a full block from every output position of the 32 bench prompts (one wave, CPU fp32) and write
    what each accepted (accept_greedy) with the pair's fingerprint."""
    import torch

    import refengine.scheduler_commit as commit
    from refengine.bench.run import engine_for, run_once
    from refengine.defaults import default_pair
    from refengine.spec_decode.accept import accept_greedy
    from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

    torch.manual_seed(0)
    target, draft = default_pair()
    prompts = bench_prompts(target)
    forced = AcceptanceOverride(parse_profile("tau1"))  # m = 0: one token a step, every position drafted from
    engine = engine_for(
        "fixed",
        str(target),
        str(draft),
        device="cpu",
        synthetic=False,
        max_num_seqs=32,
        max_model_len=PROMPT_LEN + OUTPUT + B,
        override=forced,
    )
    steps: list[list[int]] = []
    build = commit.build_verify_results

    def recording(drafts, argmax, eos_ids, ignore_eos, accepted=None):
        steps.append([accept_greedy(d, t) for d, t in zip(drafts, argmax)])  # (the wave's requests, in order)
        return build(drafts, argmax, eos_ids, ignore_eos, accepted)

    commit.build_verify_results = recording
    try:
        run_once(engine, prompts, OUTPUT)
    finally:
        commit.build_verify_results = build
    tables = [[s[i] for s in steps] for i in range(len(prompts))]  # [prompt][position]
    body = {
        "made_by": "python -m tests.unit.trained_pair_replay --write (CPU, fp32)",
        "block": B,
        "fingerprint": pair_fingerprint(target, draft, prompts),
        "tables": tables,
    }
    TABLES.write_text(json.dumps(body, separators=(",", ":")) + "\n")
    print(
        f"wrote {TABLES}: {len(tables)} prompts x {len(steps)} positions; mean accepted "
        f"{[round(sum(t) / len(t), 1) for t in tables[:8]]} ..."
    )


class Wave:
    """One mode's engine stepped on waves of the replayed pair: `mode` plain, fixed (full spans) or adaptive
    (one AdaptivePolicy across every wave, as one engine in the bench), each step priced by H200_COSTS."""

    def __init__(self, mode: str, tables: list[list[int]], policy: AdaptivePolicy | None = None):
        self.mode, self.tables, self.policy = mode, tables, policy
        self.next_id = 0
        self.carried: dict[int, int] = {}  # request -> context rows since its last draft (a catch-up's rows)
        if policy is not None:
            policy.pending = lambda r: self.carried.get(r, PROMPT_LEN)

    def run(self, prompts: list[int], tokens: int) -> tuple[float, int]:
        """A wave of the given prompts (indices into the tables), each generating `tokens`: (tok/s, verify
        steps)."""
        pol, mode = self.policy, self.mode
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        prompt_of, left = dict(zip(ids, prompts)), dict.fromkeys(ids, tokens)
        elapsed, verify_steps = PREFILL_S, 0
        if pol is not None:
            for r in ids:
                pol.admit(r, tokens, PROMPT_LEN, len(ids), len(ids))
        if mode == "fixed" or (pol is not None and any(r not in pol.retired for r in ids)):
            elapsed += PREFILL_TAPS_S
        while left:
            live = sorted(left)
            retired = pol is not None and all(r in pol.retired for r in live)  # plain decode's own step
            if mode == "adaptive" and not retired:
                want = pol.choose(live, [left[r] for r in live])
            else:
                want = [B if mode == "fixed" else 1] * len(live)
            spans = [max(1, min(s, left[r])) for s, r in zip(want, live)]
            drafted = sum(s > 1 for s in spans)
            carried = [self.carried.get(r, PROMPT_LEN) for r, s in zip(live, spans) if s > 1]
            catch_up = CATCH_UP_FIXED_S + CATCH_UP_ROW_S * sum(carried) if carried and max(carried) > B else 0.0
            draft = H200_COSTS.draft_s(drafted) + catch_up if drafted else 0.0
            verify = (
                H200_COSTS.verify_s(len(live), graph_rows(len(live), sum(spans)))
                if drafted
                else H200_COSTS.plain_s(len(live))
            )
            kind = "verify" if drafted else ("plain" if pol is not None and not retired else "engine")
            host = HOST_S[kind][0] + HOST_S[kind][1] * len(live)
            elapsed += draft + verify + host + (TAPS_S if kind == "plain" else 0.0)
            verify_steps += drafted > 0
            if pol is not None and not retired:
                pol.cost.observe_host(kind, len(live), host)
                pol.observe_step(len(live), sum(spans), drafted, draft, verify, catch_up, widest=max(spans))
            for r, s in zip(live, spans):
                table = self.tables[prompt_of[r]]
                accepted = min(s - 1, table[min(tokens - left[r], len(table) - 1)]) if s > 1 else 0
                if pol is not None:
                    pol.observe_acceptance(r, s, accepted)
                self.carried[r] = accepted + 1 if s > 1 else self.carried.get(r, PROMPT_LEN) + 1
                left[r] -= accepted + 1
                if left[r] <= 0:
                    del left[r]
                    if pol is not None:
                        pol.release(r)
        return len(prompts) * tokens / elapsed, verify_steps


def seeded_policy() -> AdaptivePolicy:
    """A policy whose cost tables hold every graph shape's H200 cost (as Engine.capture_graphs times them)."""
    pol = AdaptivePolicy(B, rows=graph_rows)
    for b in batch_buckets(32):
        pol.cost.seed("plain", b, H200_COSTS.plain_s(b))
        pol.cost.seed("draft", b, H200_COSTS.draft_s(b))
        for c in row_caps(B):
            pol.cost.seed("verify", (b, b * c), H200_COSTS.verify_s(b, b * c))
    return pol


def replay_bench(cells: list[int], rounds: int = 8) -> dict[int, list[tuple[float, int, float]]]:
    """The paired bench's order on the replayed pair: the adaptive engine settles on c32 waves, then each
    cell (its c prompts, the bench's first c) runs a 16-token warm-up and `rounds` waves. Per cell and round:
    (adaptive / plain, adaptive's verify steps, fixed / plain)."""
    tables = json.loads(TABLES.read_text())["tables"]
    pol = seeded_policy()
    engines = {m: Wave(m, tables, pol if m == "adaptive" else None) for m in ("plain", "adaptive", "fixed")}
    for _ in range(SETTLE_WAVES):
        engines["adaptive"].run(list(range(32)), OUTPUT)
    out: dict[int, list[tuple[float, int, float]]] = {}
    for c in cells:
        prompts = list(range(c))
        for e in engines.values():
            e.run(prompts, 16)
        pol.reset_stats()
        rows = []
        for _ in range(rounds):
            plain, _ = engines["plain"].run(prompts, OUTPUT)
            adaptive, verify = engines["adaptive"].run(prompts, OUTPUT)
            fixed, _ = engines["fixed"].run(prompts, OUTPUT)
            rows.append((adaptive / plain, verify, fixed / plain))
        out[c] = rows
    return out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_tables()
    else:
        for c, rows in replay_bench([1, 8, 16, 32]).items():
            print(
                f"c{c}: adaptive x plain median {median([r[0] for r in rows]):.3f}, fixed "
                f"{median([r[2] for r in rows]):.3f}, rounds {[(round(a, 3), v) for a, v, _ in rows]}"
            )
