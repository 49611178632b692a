"""HTTP fuzz (issue 51): tests/serve/fuzz_driver.py (hypothesis, in its own process) sends MAX_EXAMPLES drawn
requests (bodies of every JSON type and malformed bytes, routes, methods, headers) to the in-process server:
no answer may be a 5xx, leak a traceback or path, or be a 4xx outside the OpenAI error shape (the driver's
checks). Meanwhile /health is polled from this process and must answer every time within HEALTH_S. The run
must reach both generations (200s) and rejections (400s) in numbers, so it cannot pass without exercising
them. Bounded (examples, a deadline each, small token budgets) to run in well under a minute on 2 CPU cores.
CPU, fp32, the trained tiny pair.

Run: python -m pytest -q -s tests/serve/test_fuzz.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.serve.conftest import HealthProbe, call

MAX_EXAMPLES = 400
HEALTH_S = 0.1
DRIVER = Path(__file__).resolve().parent / "fuzz_driver.py"
WARMUP = [  # one of each kind first: a first-time code path (lazy imports, new shapes) is not an event-loop stall
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True, "stop": ["a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
]


def test_http_fuzz(spec_server):
    for p, b in WARMUP:
        status, out, _ = call(spec_server, "POST", p, b)
        assert status == 200, (p, out)
    with HealthProbe(spec_server) as probe:
        while len(probe.latencies) < 3:  # the probe's connection is up before the fuzz starts
            time.sleep(0.01)
        probe.latencies.clear()
        proc = subprocess.run(
            [sys.executable, str(DRIVER), spec_server.host, str(spec_server.port), str(MAX_EXAMPLES)],
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0, f"the fuzz found a bad answer:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    seen = json.loads(proc.stdout.strip().splitlines()[-1])["seen"]
    print(f"\n/health during the fuzz: worst {probe.worst * 1e3:.1f} ms over {len(probe.latencies)} probes; {seen}")
    assert not probe.failures, probe.failures[:5]
    assert probe.worst < HEALTH_S, f"/health took {probe.worst * 1e3:.1f} ms during the fuzz (> {HEALTH_S * 1e3} ms)"
    generated = seen.get("200 /v1/completions", 0) + seen.get("200 /v1/chat/completions", 0)
    assert generated >= 10 and seen.get("400", 0) >= 30, f"the fuzz reached too few generations or rejections: {seen}"
