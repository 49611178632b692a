"""`refengine bench --paired`: every mode against plain decode in one process, run by run, with a second plain
engine as the control.

The default bench measures each mode in a fresh process, so a ratio between two modes carries the noise
between processes: on the H200 the same plain engine ran 5-11% apart from one process to the next (docs/
PERF.md), far more than adaptive's distance from plain where speculation cannot win (tau 1, 1.3).
Here one process holds plain, a second plain engine (the control) and each requested mode; each cell's
`repeats` rounds run every engine once, in the orders of a Williams design (round_order), and each run's
`paired_x_plain` is its tok/s over the plain engine's in the same round. The control's `paired_x_plain` is the
method's own resolution: two identical engines differ by it (their weights and graphs at other addresses,
their place in the round), so a mode whose ratio to plain lies within the control's spread of 1 is not
distinguishable from plain here. The price: engines side by side run a little slower than one alone, equally
for all of them as far as the control shows.

The engines read one copy of the target's weights (`--own-weights`: one each): the process then holds one
8 GB copy at Qwen3-4B shapes instead of one per engine. Where the weights sit does not set two engines apart:
five plain engines of one process, three of them on one copy, ran their c1 decode steps at 4.04-4.18 ms on
the H200, the three sharing 4.04-4.11 (docs/PERF.md).

Why a Williams design: with the order only rotating, each engine always runs right after the same other
one, and where a run's speed depends on the run before it, that bias is the same in every round (the trained
tiny pair's control read 1.035-1.061 of plain at c32 that way, and 0.999-1.001 with this design; docs/PERF.md).
Over a cycle of n rounds (2n for an odd number of engines) each engine runs in each place and right after
each other engine equally often; `repeats` a multiple of the cycle balances the row (the JSON's
`rounds_balanced`).

Plain and the control run in every profile's rounds (the pairs need them); their rows gather all of those.
Adaptive settles again under each profile after the first, as in the default method.
"""

from __future__ import annotations

import sys
from typing import Any

from refengine.bench.job import ModeJob, job_own_bytes, job_profiles
from refengine.bench.loading import free_memory, load_engine
from refengine.bench.prompts import make_prompts
from refengine.bench.run import measure_row, print_profile, row_label, run_once, set_override, settle_engine
from refengine.spec_decode.acceptance_profile import AcceptanceOverride

CONTROL = "control (a second plain engine)"  # the control rows' acceptance label (mode "plain")
METHOD_PAIRED = (
    "paired: plain, a second plain engine (the control) and each mode in one process, settled, then each"
    " profile's cells in rounds, every engine once a round in a Williams design's order (adaptive settled again"
    " under each later profile); paired_x_plain = a run's tok/s / plain's in its round"
)


def measure_paired(modes: tuple[str, ...], j: ModeJob) -> dict[str, Any]:
    """One process's paired measurement: its runs by (mode, label, concurrency) and what the JSON records about
    the engines (a top-level function, so it pickles to a fresh process)."""
    from tqdm import tqdm

    cells = job_profiles(j)
    names = ["plain", "control", *(m for m in modes if m != "plain")]
    mode_of = {name: "plain" if name == "control" else name for name in names}  # the control is a plain engine
    engines: dict[str, Any] = {}
    out: dict[str, Any] = {"graph_captures": {}}
    shared = None  # the first engine's target, read by the others (j.share_weights: see the module docstring)
    for name in names:
        engines[name], facts = load_engine(mode_of[name], j, cells[0], shared)
        if j.share_weights and shared is None:
            shared = engines[name].target
        out["graph_captures"][name] = facts.pop("graph_capture")
        out.update(facts)
    floor, vocab, own_bytes = out["floor"], out["vocab"], job_own_bytes(out)
    settle_batch = make_prompts(j.prompts, max(j.concurrency), j.prompt_len, vocab, j.target, j.seed)
    for e in engines.values():  # the chip is warm after the first: the load is shared out
        settle_engine(e, settle_batch, j.settle_s / len(engines), j.output_tokens)
    bar = tqdm(total=len(cells) * len(j.concurrency) * j.repeats, desc="bench paired", unit="round", file=sys.stderr)
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for k, prof in enumerate(cells):
        override = AcceptanceOverride(prof, j.seed) if prof is not None else None
        labels = {}
        for name, e in engines.items():
            mode = mode_of[name]
            if mode != "plain":
                set_override(e, override)
            if mode == "adaptive" and k:  # the policy learns: its estimates describe this profile, not the last
                settle_engine(e, settle_batch, j.settle_s, j.output_tokens)
            labels[name] = CONTROL if name == "control" else row_label(mode, override, j.synthetic)
        for c in j.concurrency:
            batch, in_flight = j.cell_prompts(c, vocab)
            for e in engines.values():
                run_once(e, batch[:c], min(j.output_tokens, 16))  # warm-up (allocator, kernels, policy); discarded
            for r in range(j.repeats):
                order = round_order(names, r)  # balanced for place and predecessor (module docstring)
                got = {}
                for name in order:
                    got[name] = measure_row(
                        engines[name],
                        mode_of[name],
                        labels[name],
                        batch,
                        j.output_tokens,
                        floor,
                        own_bytes,
                        j.bandwidth,
                        in_flight,
                        j.temperature,
                    )
                base = got["plain"]["tok_per_s"]
                for name, row in got.items():
                    if name != "plain":
                        row["paired_x_plain"] = round(row["tok_per_s"] / base, 4)
                    runs.setdefault((mode_of[name], labels[name], c), []).append(row)
                bar.update()
            if j.profile_ops and c == j.concurrency[0]:
                for name, e in engines.items():
                    print_profile(e, batch[:c], min(j.output_tokens, 16), f"{name} {labels[name]} c={c}")
    bar.close()
    for name in list(engines):
        engines.pop(name).close()
    e = None  # the loops' last engine too: every one freed before the peer (or the next engines) loads
    free_memory(j.device)
    out["runs"] = runs
    out["rounds_balanced"] = j.repeats % order_cycle(len(names)) == 0
    return out


def order_cycle(n: int) -> int:
    """Rounds after which round_order has balanced n engines' places and predecessors."""
    return n if n % 2 == 0 else 2 * n


def round_order(names: list[str], r: int) -> list[str]:
    """Round r's order of the engines: row r of a Williams design, the Latin square whose first row is
    0, 1, n-1, 2, n-2, ... and each next row that one plus 1 (mod n); for odd n the mirrored rows follow.
    Over order_cycle(n) rounds each engine runs in each place, and right after each other engine, equally
    often (a first-order carry-over balanced design)."""
    n = len(names)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    k = r % order_cycle(n)
    row = [(x + k) % n for x in first]
    if k >= n:  # odd n: the mirror image of row k - n
        row.reverse()
    return [names[i] for i in row]
