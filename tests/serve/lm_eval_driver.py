"""Runs lm-eval's `local-completions` model against one or more refengine servers and writes every sample's
responses as JSON (used by tests/serve/test_lm_eval.py in a subprocess).

It is `lm_eval run --model local-completions --tasks ... --include_path tests/serve/lm_eval_tasks --log_samples`
through lm-eval's Python API, for one reason: the CLI always indexes lm-eval's ~10k built-in task YAMLs
(about 45 s on a 2-core box), and TaskManager(include_defaults=False) skips that. One process serves every URL,
so lm-eval is imported once.

Run: python tests/serve/lm_eval_driver.py OUT.json URL [URL ...]   (each URL a running `refengine serve`)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = HERE / "lm_eval_tasks"
TASK_NAMES = ["refengine_tiny_gen", "refengine_tiny_ll"]
TOKENIZER = HERE.parents[1] / "fixtures" / "tiny-trained" / "target"


def evaluate(url: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = {
        "model": "tiny-trained",
        "base_url": f"{url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(TOKENIZER),
        "max_length": 2048,
        "num_concurrent": 3,
        "max_retries": 1,
        "timeout": 60,
    }
    t0 = time.monotonic()
    out = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=TASK_NAMES,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )
    assert out is not None
    samples = {
        task: [
            {
                "doc_id": s["doc_id"],
                "resps": s["resps"],
                "filtered_resps": s["filtered_resps"],
                **{m: s[m] for m in ("exact_match", "acc") if m in s},
            }
            for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])
        ]
        for task in TASK_NAMES
    }
    return {"url": url, "seconds": round(time.monotonic() - t0, 2), "results": out["results"], "samples": samples}


def main(argv: list[str]) -> int:
    out_path, urls = Path(argv[0]), argv[1:]
    t0 = time.monotonic()
    runs = [evaluate(u) for u in urls]
    out_path.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 2), "runs": runs}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
