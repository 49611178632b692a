"""The `refengine generate` command on the embedded trained tiny pair (CPU, fp32): the README's main job.

Checks that the default command decodes text, prints the JSON stats line last, really accepts drafts
(tau >= 3 on the issue's `def fibonacci(n):` prompt at the default 256 new tokens; measured 4.72), that
the DFlash text equals plain greedy text token for token, and that a text prompt for a checkpoint without a
tokenizer fails with exit code 2 and a message saying what to pass instead.

Run: python -m pytest tests/unit/test_cli.py -q
"""

from __future__ import annotations

import json
import os

import pytest

from refengine.cli import main
from refengine.defaults import RANDOM_PAIR, TRAINED_PAIR, default_pair

PROMPT = "def fibonacci(n):"


def _run(capsys, *argv: str) -> tuple[str, dict, str]:
    rc = main(["generate", "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, f"refengine generate exited {rc}: {err}"
    lines = out.rstrip("\n").splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1]), err


def test_generate_default_pair_accepts_and_is_lossless(capsys):
    target, _ = default_pair()
    assert target == TRAINED_PAIR / "target", f"the embedded default should be the trained tiny pair, got {target}"
    text, stats, err = _run(capsys, "--prompt", PROMPT)
    assert text.startswith(PROMPT), text[:200]
    assert stats["tokens"] == 256, stats
    assert "tau" in stats and "[dflash" in err, err
    assert stats["tau"] >= 3.0, f"tau {stats['tau']} < 3 on {PROMPT!r}: histogram {stats['accepted_hist']}"
    plain_text, plain_stats, _ = _run(capsys, "--prompt", PROMPT, "--no-draft")
    assert "tau" not in plain_stats
    if plain_text != text:
        at = len(os.path.commonprefix([plain_text, text]))
        pytest.fail(
            f"DFlash text differs from plain greedy at character {at}: "
            f"plain {plain_text[at : at + 60]!r} vs dflash {text[at : at + 60]!r}"
        )


def test_text_prompt_without_tokenizer_is_a_clear_error(capsys):
    rc = main(["generate", "--device", "cpu", "--model", str(RANDOM_PAIR / "target"), "--prompt", "hello"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "no tokenizer.json" in err and "token ids" in err, err
