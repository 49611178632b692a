"""Every bad command line gets one line on stderr and a non-zero exit, never a traceback: bad --concurrency
lists (0, non-integers) and lengths are argparse usage errors (exit 2); `refengine bench` fails (exit 2,
the rejection message) when a request is rejected, here every one (--prompt-len 5000), or does not run its
budget, instead of printing 0 tok/s; a RefEngineError from `refengine memory` reaches cli.main and prints
`refengine: <Type>: <message>`.

Run: python -m pytest -q tests/unit/test_cli_errors.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refengine import FinishReason, Request, SamplingParams
from refengine.bench.run import BenchError, check_ran
from refengine.cli import main
from refengine.defaults import RANDOM_PAIR

QWEN3_4B = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "qwen3-4b"


def _fails(capsys, *argv: str) -> str:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse usage errors exit from parse_args
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, f"{' '.join(argv)}: exit {rc}, stdout {out[-300:]!r}"
    bare = re.sub(r"\r?bench[^:\r\n]*:[^\r\n]*?run/s\]", "", err)  # minus bench's progress bars (one per mode)
    lines = [s for s in re.split(r"[\r\n]", bare) if s.strip()]
    assert "Traceback" not in err and len(lines) == 1, f"not one line: {err!r}"
    return lines[0] + "\n"


@pytest.mark.parametrize(
    "value,message",
    [
        ("2,0", "--concurrency '2,0': give positive integers, comma-separated"),
        ("a,b", "--concurrency 'a,b': give positive integers, comma-separated"),
        ("", "--concurrency '': give positive integers, comma-separated"),
    ],
)
def test_bench_concurrency_is_validated(capsys, value, message):
    err = _fails(capsys, "bench", "--device", "cpu", "--concurrency", value)
    assert err.startswith("refengine: BenchError: ") and message in err, err


def test_bench_lengths_are_validated(capsys):
    assert "--repeats, --output-tokens and --prompt-len must be positive" in _fails(
        capsys, "bench", "--prompt-len", "0"
    )
    assert "argument --output-tokens: invalid int value: 'x'" in _fails(capsys, "bench", "--output-tokens", "x")
    # several processes per mode need each mode in a fresh process (--isolate; on the CPU it is off)
    assert "processes=2: give 1, or more with each mode in a fresh process" in _fails(
        capsys, "bench", "--device", "cpu", "--processes", "2"
    )


def test_bench_fails_when_every_request_is_rejected(capsys):
    err = _fails(
        capsys,
        "bench",
        "--device",
        "cpu",
        "--target",
        str(RANDOM_PAIR / "target"),
        "--concurrency",
        "1",
        "--prompt-len",
        "5000",
        "--output-tokens",
        "4",
    )
    assert err.startswith(
        "refengine: BenchError: 1 of 1 bench requests were rejected (context_length): prompt 5000 + max_tokens "
    ), err


def test_bench_row_that_ran_short_is_an_error():
    req = Request(3, [1, 2], SamplingParams(max_tokens=4))
    req.finish(FinishReason.ERROR, "request 3: 2 steps it was part of failed")
    other = Request(4, [1, 2], SamplingParams(max_tokens=4))
    other.output_ids = [5, 6, 7, 8]
    with pytest.raises(BenchError, match=r"bench request 3 ran 0 of 4 tokens \(error\) request 3: 2 steps"):
        check_ran([other, req], 4)


def test_memory_errors_go_through_cli_main(capsys, tmp_path):
    err = _fails(capsys, "memory", "--target", str(tmp_path / "missing"), "--gpu-mem-gib", "16")
    assert err.startswith("refengine: CheckpointError: ") and "no config.json" in err, err
    err = _fails(capsys, "memory", "--target", str(QWEN3_4B), "--gpu-mem-gib", "1")
    assert err.startswith("refengine: KvBudgetError: target weights needs ") and "1024 MiB" in err, err
