"""DFlash memory reservation, KV budget planner and `refengine memory`, on CPU from shape-only configs.

Checks:
* every upstream figure for Qwen3-4B + DFlash-b16 (upstream pegainfer's DFlash PR), exactly: 65,536 B per
  token and its four terms, the fixed terms, 2,959,605,760 B at decode batch 256 and 1,189,212,160 B at 1,
  2,359,296 -> 3,407,872 B per block, the 16 GB / 0.90 table (150 / 4113 / 1828 off, 2972 / 1389 / 427 on);
* the lane accounting never under-reserves: the exact CPU tensors the drafter lane allocates, for fixed and
  hypothesis-drawn (shapes, N, lifetimes), fit in what is reserved, and fill it exactly in the tight case;
* the planner refuses with a KvBudgetError that names the numbers and a change that does make it fit;
* the CLI prints the table (run in-process) and ends with a matching JSON line.

Run: pytest tests/unit/test_memory.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS, DFlashConfig, ModelConfig
from refengine.errors import CheckpointError, KvBudgetError, RefEngineError, UnsupportedConfigError
from refengine.memory.cli import add_memory_parser
from refengine.memory.planner import DeviceMemory, GiB, KvBudgetPlan, MiB, mib, plan_kv_budget
from refengine.memory.reservation import DFlashMemoryReservation, load_config, target_weight_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
TARGET, DRAFT = CONFIGS / "qwen3-4b", CONFIGS / "qwen3-4b-dflash-b16"


def reservation(**kw) -> DFlashMemoryReservation:
    """Upstream's setup (its accounting, decode batch 256) unless told otherwise: its figures are the anchor."""
    return DFlashMemoryReservation.from_config(
        TARGET, DRAFT, **{"accounting": "upstream", "max_decode_batch": 256, **kw}
    )


def check(name: str, got, want) -> None:
    assert got == want, f"{name}: got {got:,} want {want:,} (diff {got - want:+,})"


# -- upstream accounting: every figure of upstream's DFlash PR ------------------------------------
def test_upstream_per_token_terms_for_qwen3_4b():
    r = reservation()
    check("draft KV = 5 x 2 x 1024 x 2", r.draft_kv_bytes_per_token, 20_480)
    check("context scratch = 2 x 2560 x 2", r.context_scratch_bytes_per_token, 10_240)
    check("tail scratch = (2560 + 2 x 1024) x 2", r.tail_scratch_bytes_per_token, 9_216)
    check("pending features = 2560 x 5 x 2", r.pending_features_bytes_per_token, 25_600)
    check(
        "upstream's 'scratch-ctx' = context + tail",
        r.context_scratch_bytes_per_token + r.tail_scratch_bytes_per_token,
        19_456,
    )
    check("per-token bytes", r.per_token_bytes, 65_536)


def test_upstream_fixed_terms_for_qwen3_4b():
    r = reservation()
    check("drafter weights", r.drafter_weights_bytes, 1_074_790_400)
    check("weights + 10% slack", r.drafter_weights_bytes + r.weights_slack_bytes, 1_182_269_440)
    check(
        "dense scratch per decode slot: 2 x (V + 5H + 2Q + 3I) x 16",
        (r.batch_dense_scratch_bytes + r.batch_logits_scratch_bytes) // 256,
        6_467_584,
    )
    check("batch scratch at 256", r.batch_dense_scratch_bytes + r.batch_logits_scratch_bytes, 1_655_701_504)
    check("headroom = 256 x 16 x (20,480 + 9,216)", r.block_headroom_bytes, 121_634_816)
    check("fixed bytes at decode batch 256", r.fixed_bytes, 2_959_605_760)
    check("fixed bytes at decode batch 1", reservation(max_decode_batch=1).fixed_bytes, 1_189_212_160)


def test_upstream_bytes_per_block_and_context_limit():
    r = reservation()
    check("target bytes_per_block = 36 x 2 x 1024 x 16 x 2", r.target_bytes_per_block, 2_359_296)
    check("effective bytes_per_block", r.effective_bytes_per_block, 3_407_872)
    check("effective x 9 == target x 13 (the x1.444)", r.effective_bytes_per_block * 9, r.target_bytes_per_block * 13)
    check("max context = min(40960, 40960 - 16)", r.max_context_tokens, 40_944)


def test_config_sources_dict_directory_and_file_agree():
    as_dicts = DFlashMemoryReservation.from_config(load_config(TARGET), load_config(DRAFT))
    as_files = DFlashMemoryReservation.from_config(TARGET / "config.json", DRAFT / "config.json")
    assert as_dicts == as_files == DFlashMemoryReservation.from_config(TARGET, DRAFT)


def test_bad_configs_fail_with_typed_errors():
    with pytest.raises(CheckpointError, match="config.json"):
        DFlashMemoryReservation.from_config(CONFIGS / "missing", DRAFT)
    wrong_taps = {**load_config(DRAFT), "num_target_layers": 28}
    with pytest.raises(UnsupportedConfigError, match="num_target_layers 28"):
        DFlashMemoryReservation.from_config(TARGET, wrong_taps)
    with pytest.raises(UnsupportedConfigError, match="accounting"):
        reservation(accounting="optimistic")
    with pytest.raises(UnsupportedConfigError, match="must be a non-negative int"):
        dataclasses.replace(reservation(), block_headroom_bytes=-1)
    with pytest.raises(UnsupportedConfigError, match="lane accounting"):
        dataclasses.replace(reservation(accounting="lane"), tail_scratch_bytes_per_token=1)


# -- lane accounting: what the drafter lane allocates, as real CPU tensors --------------------------------------
def lane_buffers(
    target: ModelConfig, drafter: DFlashConfig, lifetimes: list[int], max_batch: int
) -> list[torch.Tensor]:
    """The lane's allocations: per request context K/V and pending features; one shared batch scratch."""
    d, block, dt = drafter.model, drafter.block_size, torch.bfloat16
    taps = len(drafter.target_layer_ids)
    out = []
    for lifetime in lifetimes:
        capacity = lifetime + block  # prompt + max_tokens + one in-fill block
        for _ in range(d.num_layers):
            out.append(torch.empty(capacity, d.num_kv_heads, d.head_dim, dtype=dt))  # context K [cap, nkv, d]
            out.append(torch.empty(capacity, d.num_kv_heads, d.head_dim, dtype=dt))  # context V [cap, nkv, d]
        out.append(torch.empty(capacity, taps * target.hidden_size, dtype=dt))  # pending [cap, n*Ht]
    rows = max_batch * block  # allocated once for the largest batch
    out += [
        torch.empty(rows, d.hidden_size, dtype=dt),  # hidden [N*B, H]
        torch.empty(rows, d.q_dim, dtype=dt),  # q [N*B, nh*d]
        torch.empty(rows, d.kv_dim, dtype=dt),
        torch.empty(rows, d.kv_dim, dtype=dt),  # k, v [N*B, nkv*d]
        torch.empty(rows, d.intermediate_size, dtype=dt),  # gate [N*B, I]
        torch.empty(rows, d.intermediate_size, dtype=dt),  # up [N*B, I]
        torch.empty(max_batch * (block - 1), target.vocab_size, dtype=dt),
    ]  # logits [N*(B-1), V]
    r = min(DRAFT_CONTEXT_FLUSH_ROWS, sum(lifetimes))  # one chunk of pending context rows in projection
    out += [
        torch.empty(r, taps * target.hidden_size, dtype=dt),  # concatenated features
        torch.empty(r, d.hidden_size, dtype=dt),
        torch.empty(r, d.hidden_size, dtype=dt),  # fc out, normed
        torch.empty(r, 3 * d.hidden_size, dtype=torch.float32),  # hidden_norm fp32 temps
        torch.empty(r, 2 * d.kv_dim, dtype=torch.float32),
    ]  # k_norm fp32 temps
    out += [torch.empty(r, d.num_kv_heads, d.head_dim, dtype=dt) for _ in range(2 * d.num_layers)]  # K, V
    return out


def allocated_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def models(target_cfg, draft_cfg) -> tuple[ModelConfig, DFlashConfig]:
    return ModelConfig.from_hf(load_config(target_cfg)), DFlashConfig.from_hf(load_config(draft_cfg))


def test_lane_terms_for_qwen3_4b():
    r = reservation(accounting="lane")
    check("per token = draft KV 20,480 + pending 25,600", r.per_token_bytes, 46_080)
    check(
        "dense scratch = 2 x (2560 + 4096 + 2 x 1024 + 2 x 9728) x 16 x 256", r.batch_dense_scratch_bytes, 230_686_720
    )
    check("logits scratch = 2 x 151936 x 15 x 256", r.batch_logits_scratch_bytes, 1_166_868_480)
    check("headroom = 256 x 16 x 46,080", r.block_headroom_bytes, 188_743_680)
    check(
        "flush = 4096 x (25,600 + 2 x 2 x 2560 + 3 x 4 x 2560 + 2 x 4 x 1024 + 20,480)",
        r.context_flush_scratch_bytes,
        4096 * 95_232,
    )
    check("fixed", r.fixed_bytes, 2_768_568_320 + 4096 * 95_232)
    check("effective bytes_per_block", r.effective_bytes_per_block, 3_096_576)


@pytest.mark.parametrize(
    "max_batch,lifetimes", [(1, [1]), (2, [17]), (4, [100, 1, 513]), (8, [33] * 8), (8, [4096, 15, 16, 2000])]
)
def test_lane_reservation_covers_qwen3_4b_lane_buffers(max_batch, lifetimes):
    target, drafter = models(TARGET, DRAFT)
    allocated = allocated_bytes(lane_buffers(target, drafter, lifetimes, max_batch))
    for accounting in ("lane",):  # "upstream" bills upstream's engine, not refengine's lane (see memory/reservation.py)
        reserved = reservation(accounting=accounting, max_decode_batch=max_batch).buffers_reserved_bytes(lifetimes)
        assert allocated <= reserved, (
            f"{accounting} under-reserves N={len(lifetimes)} lifetimes={lifetimes}: "
            f"allocated {allocated:,} > reserved {reserved:,}"
        )


def test_lane_reservation_is_exact_when_every_slot_is_full_and_page_aligned():
    target, drafter = models(TARGET, DRAFT)
    lifetimes = [1024, 2048, 512, 512]  # multiples of the page, N == max decode batch, a full flush chunk
    allocated = allocated_bytes(lane_buffers(target, drafter, lifetimes, max_batch=4))
    check(
        "lane reserved == allocated",
        reservation(accounting="lane", max_decode_batch=4).buffers_reserved_bytes(lifetimes),
        allocated,
    )


def test_dropping_a_lane_term_is_caught():
    # The coverage check is not vacuous: without the B rows of headroom per request, it fails.
    target, drafter = models(TARGET, DRAFT)
    lifetimes = [2048, 2048]  # page-aligned and a full flush chunk: only the headroom is left to catch
    short = dataclasses.replace(reservation(accounting="lane", max_decode_batch=2), block_headroom_bytes=0)
    assert allocated_bytes(lane_buffers(target, drafter, lifetimes, 2)) > short.buffers_reserved_bytes(lifetimes)


def test_drafter_weights_fit_in_weights_plus_slack():
    target, drafter = models(TARGET, DRAFT)
    d, h = drafter.model, drafter.model.hidden_size
    shapes = [(h, len(drafter.target_layer_ids) * target.hidden_size), (h,), (h,)]  # fc, hidden_norm, norm
    for _ in range(d.num_layers):
        shapes += [
            (h,),
            (h,),
            (d.q_dim, h),
            (d.kv_dim, h),
            (d.kv_dim, h),
            (h, d.q_dim),
            (d.head_dim,),
            (d.head_dim,),
            (d.intermediate_size, h),
            (d.intermediate_size, h),
            (h, d.intermediate_size),
        ]
    tensors = [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes]
    assert len(tensors) == 58  # the z-lab drafter's tensor list: 5 layers x 11 + fc, hidden_norm, norm
    stored = sum(t.numel() * t.element_size() for t in tensors)
    r = reservation()
    check("stored drafter bytes", stored, 1_074_854_400)
    assert r.drafter_weights_bytes < stored <= r.drafter_weights_bytes + r.weights_slack_bytes, (
        f"weights {r.drafter_weights_bytes:,} (no norms) < stored {stored:,} <= + slack {r.weights_slack_bytes:,}"
    )


def tiny_pair(layers, nkv, group, head_dim, hidden, inter, vocab, taps, block, target_layers=6):
    common = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "num_attention_heads": nkv * group,
        "num_key_value_heads": nkv,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
    }
    target = {**common, "num_hidden_layers": target_layers}
    draft = {
        **common,
        "num_hidden_layers": layers,
        "block_size": block,
        "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": list(range(taps))},
    }
    return target, draft


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    nkv=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 8]),
    hidden=st.integers(4, 48),
    inter=st.integers(4, 64),
    vocab=st.integers(8, 200),
    taps=st.integers(1, 3),
    block=st.integers(2, 8),
    page=st.integers(1, 8),
    max_batch=st.integers(1, 4),
    data=st.data(),
)
def test_lane_accounting_never_under_reserves_lane_buffers(
    layers, nkv, group, head_dim, hidden, inter, vocab, taps, block, page, max_batch, data
):
    target_cfg, draft_cfg = tiny_pair(layers, nkv, group, head_dim, hidden, inter, vocab, taps, block)
    lifetimes = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=max_batch))
    allocated = allocated_bytes(lane_buffers(*models(target_cfg, draft_cfg), lifetimes, max_batch))
    for accounting in ("lane",):  # "upstream" bills upstream's engine (per-request scratch), not this lane
        r = DFlashMemoryReservation.from_config(
            target_cfg, draft_cfg, page_size=page, max_decode_batch=max_batch, accounting=accounting
        )
        reserved = r.buffers_reserved_bytes(lifetimes)
        assert allocated <= reserved, f"{accounting}: allocated {allocated:,} > reserved {reserved:,} ({r})"


# -- planner: upstream's 16 GB / 0.90 table --------------------------------------------------------------------
WEIGHTS = target_weight_bytes(ModelConfig.from_hf(load_config(TARGET)))
CARD = DeviceMemory(16 * GiB, 16 * GiB, "16 GB card").after_loading(WEIGHTS, "Qwen3-4B weights")
# Each launch's measured CUDA context + activation peak, solved back from its row (memory_plan docstring).
OVERHEAD_OFF_MIB, OVERHEAD_ON_MIB = 2810, 2711
UPSTREAM_TABLE = {"off": (150, 4113, 1828), "on": (2972, 1389, 427)}  # margin MiB, budget MiB, blocks


def plan_row(dflash: bool, overhead_mib: int, **kw) -> KvBudgetPlan:
    return plan_kv_budget(
        CARD,
        target_config=TARGET,
        gpu_memory_utilization=0.90,
        reservation=reservation() if dflash else None,
        activation_peak_bytes=overhead_mib * MiB,
        **kw,
    )


def row(plan: KvBudgetPlan) -> tuple[int, int, int]:
    return mib(plan.margin_bytes), mib(plan.kv_budget_bytes), plan.num_blocks


def test_upstream_table_dflash_off():
    check("Qwen3-4B weights (tied head counted once)", WEIGHTS, 8_044_936_192)
    got = row(plan_row(False, OVERHEAD_OFF_MIB))
    assert got == UPSTREAM_TABLE["off"], f"(margin MiB, budget MiB, blocks) {got} != upstream {UPSTREAM_TABLE['off']}"


def test_upstream_table_dflash_on():
    plan = plan_row(True, OVERHEAD_ON_MIB)
    assert row(plan) == UPSTREAM_TABLE["on"], f"{row(plan)} != upstream {UPSTREAM_TABLE['on']}"
    check("pool allocated at target-only bytes", plan.pool_bytes, 427 * 2_359_296)
    check("margin = 150 MiB + fixed", plan.margin_bytes, 150 * MiB + 2_959_605_760)


def test_table_blocks_follow_from_the_printed_budgets():
    # Independent of any measurement: upstream's blocks from its own MiB budgets and per-block sizes.
    r = reservation()
    check("4113 MiB / 2.25 MiB", 4113 * MiB // r.target_bytes_per_block, 1828)
    check("1389 MiB / 3.25 MiB", 1389 * MiB // r.effective_bytes_per_block, 427)
    check("margin floor", mib(150 * MiB + r.fixed_bytes), 2972)


def test_no_single_measurement_reproduces_both_rows():
    both = [
        o
        for o in range(2000, 3500)
        if row(plan_row(False, o)) == UPSTREAM_TABLE["off"] and row(plan_row(True, o)) == UPSTREAM_TABLE["on"]
    ]
    assert both == [], f"overheads reproducing both rows: {both}"


def test_full_length_requests():
    plan = plan_row(True, OVERHEAD_ON_MIB, max_context_tokens=4096)
    check("blocks per 4096-token request", plan.blocks_per_full_length_request, 256)
    check("427 // 256", plan.max_full_length_requests, 1)
    check("at the 40,944 limit", plan_row(True, OVERHEAD_ON_MIB).max_full_length_requests, 0)


# -- planner refusals -----------------------------------------------------------------------------------------
def test_refuses_when_the_weights_leave_nothing():
    small = DeviceMemory(8 * GiB, 8 * GiB).after_loading(WEIGHTS, "weights")
    with pytest.raises(KvBudgetError, match=r"raise the gpu memory utilisation \(now 0.90\)") as e:
        plan_kv_budget(small, target_config=TARGET, gpu_memory_utilization=0.90)
    assert "below the 64-block minimum" in str(e.value) and "used 7672" in str(e.value), str(e.value)
    assert isinstance(e.value, RefEngineError)
    with pytest.raises(KvBudgetError, match="needs 7672 MiB but only 4096 MiB"):
        DeviceMemory(4 * GiB, 4 * GiB).after_loading(WEIGHTS, "weights")


def test_refusal_advice_to_lower_the_decode_batch_works():
    plan_row(False, 3900)  # DFlash off still fits
    with pytest.raises(KvBudgetError, match=r"lower the max decode batch \(now 256") as e:
        plan_row(True, 3900)
    assert "DFlash fixed 2822" in str(e.value), str(e.value)
    smaller = plan_kv_budget(
        CARD, target_config=TARGET, reservation=reservation(max_decode_batch=32), activation_peak_bytes=3900 * MiB
    )
    assert smaller.num_blocks >= 64, smaller


def test_budget_that_affords_the_floor_only_without_the_draft_charge_is_refused():
    r = reservation()
    budget = 64 * r.target_bytes_per_block + MiB  # 64 target blocks, but not 64 effective ones
    device = DeviceMemory(budget, budget)
    assert plan_kv_budget(device, target_config=TARGET, gpu_memory_utilization=1.0, margin_bytes=0).num_blocks == 64
    with pytest.raises(KvBudgetError, match="affords 44 blocks"):
        plan_kv_budget(
            device,
            target_config=TARGET,
            gpu_memory_utilization=1.0,
            margin_bytes=0,
            reservation=dataclasses.replace(
                r,
                drafter_weights_bytes=0,
                weights_slack_bytes=0,
                batch_dense_scratch_bytes=0,
                batch_logits_scratch_bytes=0,
                block_headroom_bytes=0,
            ),
        )


def test_refuses_too_few_full_length_requests_and_says_shorten_the_context():
    with pytest.raises(KvBudgetError, match=r"shorter max context \(now 40944"):
        plan_row(True, OVERHEAD_ON_MIB, min_full_length_requests=1)
    assert plan_row(True, OVERHEAD_ON_MIB, max_context_tokens=4096, min_full_length_requests=1).num_blocks == 427


def test_planner_rejects_bad_inputs():
    with pytest.raises(UnsupportedConfigError, match="gpu_memory_utilization"):
        plan_kv_budget(CARD, target_config=TARGET, gpu_memory_utilization=1.5)
    with pytest.raises(UnsupportedConfigError, match="page"):
        plan_kv_budget(CARD, target_config=TARGET, reservation=reservation(), page_size=32)
    with pytest.raises(UnsupportedConfigError, match="max_context_tokens=40960"):
        plan_row(True, OVERHEAD_ON_MIB, max_context_tokens=40960)  # past the DFlash limit 40,944
    with pytest.raises(UnsupportedConfigError, match="free"):
        DeviceMemory(GiB, 2 * GiB)
    with pytest.raises(ValueError, match="blocks = budget // effective"):
        dataclasses.replace(plan_row(False, OVERHEAD_OFF_MIB), num_blocks=1829)


# -- CLI --------------------------------------------------------------------------------------------------------
def run_cli(*argv: str) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser()
    add_memory_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["memory", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = args.func(args)
    return rc, out.getvalue().splitlines()


def table_row(lines: list[str], name: str) -> tuple[int, int, int]:
    cells = next(line for line in lines if line.startswith(name))[len(name) :].split()
    return int(cells[0]), int(cells[1]), int(cells[2])


@pytest.mark.parametrize(
    "overhead,expect_off,expect_on",
    [
        (None, UPSTREAM_TABLE["off"], UPSTREAM_TABLE["on"]),  # default: each launch's own measurement
        (str(OVERHEAD_OFF_MIB), UPSTREAM_TABLE["off"], (2972, 1290, 397)),  # one overhead for both rows
        (str(OVERHEAD_ON_MIB), (150, 4212, 1872), UPSTREAM_TABLE["on"]),
    ],
)
def test_cli_prints_the_table(overhead, expect_off, expect_on):
    flags = [] if overhead is None else ["--runtime-overhead-mib", str(overhead)]
    rc, lines = run_cli(
        "--target",
        str(TARGET),
        "--draft",
        str(DRAFT / "config.json"),
        "--gpu-mem-gib",
        "16",
        "--util",
        "0.90",
        "--accounting",
        "upstream",
        "--max-decode-batch",
        "256",
        *flags,
    )
    assert rc == 0, "\n".join(lines)
    assert (table_row(lines, "DFlash off"), table_row(lines, "DFlash on")) == (expect_off, expect_on), "\n".join(lines)
    assert any("= 65,536 B" in line for line in lines), "\n".join(lines)
    summary = json.loads(lines[-1])
    assert (summary["off"]["margin_mib"], summary["off"]["kv_budget_mib"], summary["off"]["num_blocks"]) == expect_off
    assert (summary["on"]["margin_mib"], summary["on"]["kv_budget_mib"], summary["on"]["num_blocks"]) == expect_on
    assert summary["reservation"]["fixed_bytes"] == 2_959_605_760, summary["reservation"]


def test_cli_reports_a_row_that_does_not_fit():
    rc, lines = run_cli(
        "--target",
        str(TARGET),
        "--draft",
        str(DRAFT),
        "--gpu-mem-gib",
        "12",
        "--accounting",
        "lane",
        "--max-decode-batch",
        "256",
        "--max-context",
        "4096",
    )
    summary = json.loads(lines[-1])
    assert rc == 1 and "does not fit" in "\n".join(lines), "\n".join(lines)
    assert summary["off"]["num_blocks"] == 189 and "lower the max decode batch" in summary["on"]["error"], summary


def test_cli_defaults_are_the_engines():
    """Without flags the table describes the setup EngineConfig runs (lane accounting, its decode batch)."""
    from refengine import EngineConfig

    rc, lines = run_cli("--target", str(TARGET), "--draft", str(DRAFT), "--gpu-mem-gib", "80")
    engine = EngineConfig("unused")
    summary = json.loads(lines[-1])
    assert rc == 0, "\n".join(lines)
    assert summary["reservation"]["accounting"] == engine.memory_accounting, summary["reservation"]
    assert summary["on"]["page_size"] == engine.page_size
    expected = DFlashMemoryReservation.from_config(
        TARGET,
        DRAFT,
        page_size=engine.page_size,
        max_decode_batch=engine.max_num_seqs,
        accounting=engine.memory_accounting,
    )
    assert summary["reservation"]["fixed_bytes"] == expected.fixed_bytes


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--page-size", "0", "positive integer"),
        ("--util", "1.5", "fraction in (0, 1]"),
        ("--max-decode-batch", "x", "positive integer"),
    ],
)
def test_cli_bad_numbers_fail_before_printing(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("--target", str(TARGET), "--gpu-mem-gib", "16", flag, value)
    captured = capsys.readouterr()
    assert exc.value.code == 2 and message in captured.err and captured.out == "", captured


def test_cli_bad_path_is_a_usage_error(capsys):
    from refengine.cli import main  # RefEngineErrors of every subcommand are printed by cli.main, exit 2

    rc = main(["memory", "--target", str(CONFIGS / "missing"), "--gpu-mem-gib", "16"])
    assert rc == 2 and "refengine: CheckpointError: " in capsys.readouterr().err


# -- real device (skipped without CUDA) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_reading_and_activation_profile():
    from refengine.memory.device import profile_activation_peak, read_device_memory

    device = read_device_memory("cuda")
    assert 0 < device.free_bytes <= device.total_bytes, device
    peak = profile_activation_peak(lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda").fill_(1))
    assert peak.non_kv_peak_increase_bytes >= 64 * MiB, peak
