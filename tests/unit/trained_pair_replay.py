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

from refengine.spec_decode.step_costs import CostModel
from tests.unit.test_adaptive import _simulate_phases

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


def replay_bench(cells: list[int], rounds: int = 8) -> dict[int, list[tuple[float, float]]]:
    """The paired bench's order on the replayed pair, stepped by test_adaptive's _simulate_phases (one adaptive
    policy through every phase, as one engine in the bench; every graph shape's cost seeded, as
    Engine.capture_graphs times them): the adaptive engine settles on c32 waves, then each cell (its c prompts,
    the bench's first c) runs a 16-token warm-up and `rounds` waves. Per cell and round: (adaptive / plain,
    fixed full spans / plain)."""
    tables = json.loads(TABLES.read_text())["tables"]
    phases = [(32, 0.0, SETTLE_WAVES, OUTPUT)]  # (concurrency, unused draw rate, waves, tokens)
    prompt_of = list(range(32)) * SETTLE_WAVES  # request id (in arrival order) -> its prompt
    for c in cells:
        phases += [(c, 0.0, 1, 16)] + [(c, 0.0, 1, OUTPUT)] * rounds
        prompt_of += list(range(c)) * (1 + rounds)

    def accept(req: int, generated: int, span: int) -> int:
        table = tables[prompt_of[req]]
        return min(span - 1, table[min(generated, len(table) - 1)])

    looks = dict(prefill_s=PREFILL_S, prefill_taps_s=PREFILL_TAPS_S, taps_s=TAPS_S, catch_up_fixed_s=CATCH_UP_FIXED_S)
    kw = dict(true=H200_COSTS, seeded=True, host=HOST_S, catch_up_row_s=CATCH_UP_ROW_S, accept=accept, **looks)
    tok_s = {m: _simulate_phases(m, phases, **kw) for m in ("plain", "adaptive", "fixed")}
    out, at = {}, 1
    for c in cells:
        at += 1  # (the cell's warm-up)
        out[c] = [
            (tok_s["adaptive"][i] / tok_s["plain"][i], tok_s["fixed"][i] / tok_s["plain"][i])
            for i in range(at, at + rounds)
        ]
        at += rounds
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
                f"{median([r[1] for r in rows]):.3f}, rounds {[round(a, 3) for a, _ in rows]}"
            )
