"""The pytest options of `pytest --pyargs golden.conformance` (golden/conformance.py), for an engine's CI.

    pytest -p golden.conform.pytest_plugin --pyargs golden.conformance \\
        --conform-url http://127.0.0.1:8000 --conform-model NAME --conform-pair DIR [--junitxml conform.xml]

Registered as the `pytest11` entry point `golden.conform.pytest_plugin` (pyproject.toml), so after
`pip install` the `-p` is optional; giving it anyway is harmless (the plugin is registered once by that name).
Every option maps to the `python -m golden conform` flag of the same name (golden/conform/cli.py);
`--conform-checks` runs a subset, and the checks left out are skipped, saying so.
"""

from __future__ import annotations

import pytest

OPTIONS: dict[str, str] = {  # --conform-X -> conform flag, help
    "url": "the server under test, http://host:port",
    "model": "the model name it serves",
    "pair": "golden/data/<pair> or the HF checkpoint it runs",
    "baseline-url": "the same model with speculation off",
    "tol": "hf gate tolerances: bf16 (default) or fp32",
    "tau-tol": "relative tau band",
    "prompts": "only the first N golden prompts",
    "hf-model": "HF checkpoint that scores divergences",
    "tokenizer": "tokenizer.json mapping token strings to ids",
    "server": "auto, refengine, vllm or sglang",
    "scorer-device": "HF scorer device",
    "scorer-dtype": "HF scorer dtype",
    "api-key": "Authorization: Bearer KEY",
    "checks": "comma-separated subset of the checks (the others are skipped)",
    "sampling-temperature": "sampling check: temperature",
    "sampling-top-p": "sampling check: top_p",
    "sampling-top-k": "sampling check: top_k",
    "sampling-max-tokens": "sampling check: max_tokens per request",
    "sampling-seed": "sampling check: request i is seeded this + i",
    "sampling-concurrency": "sampling check: requests in flight",
}
FLAGS: dict[str, str] = {  # --conform-X (no value) -> conform flag, help
    "sampling-ignore-eos": "sampling check: send ignore_eos",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("golden conform", "golden conform: the golden gates against a running server")
    for name, helptext in OPTIONS.items():
        group.addoption(f"--conform-{name}", dest=f"conform_{name.replace('-', '_')}", default=None, help=helptext)
    for name, helptext in FLAGS.items():
        dest = f"conform_{name.replace('-', '_')}"
        group.addoption(f"--conform-{name}", dest=dest, action="store_true", default=False, help=helptext)


def conform_argv(config: pytest.Config) -> list[str]:
    """The `python -m golden conform` command line the options describe."""
    argv = ["conform"]
    for name in OPTIONS:
        value = config.getoption(f"conform_{name.replace('-', '_')}")
        if value is not None:
            argv += [f"--{name}", str(value)]
    return argv + [f"--{name}" for name in FLAGS if config.getoption(f"conform_{name.replace('-', '_')}")]
