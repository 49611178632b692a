"""`refengine serve-bench` (refengine/server/loadtest.py, stdlib-only load client) against the in-process
server: N concurrent streaming clients, requests/s and tok/s as JSON; and `refengine serve` is registered in
the CLI with its flags.

Run: python -m pytest -q tests/serve/test_loadtest.py
"""

from __future__ import annotations

import json

from refengine.cli import build_parser, main


def test_serve_bench_reports_throughput(spec_server, capsys):
    rc = main(
        [
            "serve-bench",
            "--url",
            spec_server.url,
            "--concurrency",
            "4",
            "--max-tokens",
            "8",
            "--requests",
            "8",
            "--duration",
            "30",
            "--timeout",
            "30",
        ]
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["errors"] == 0 and res["requests"] == 8
    assert res["tokens"] > 0 and res["tok_per_s"] > 0 and res["requests_per_s"] > 0


def test_serve_subcommand_flags():
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--no-draft", "--device", "cpu", "--host", "127.0.0.1"]
    )
    assert (args.port, args.no_draft, args.device, args.model, args.dflash_draft_model_path) == (
        9000,
        True,
        "cpu",
        None,
        None,
    )
    assert args.func.__name__ == "cmd_serve"


def test_serve_bench_soak(spec_server, capsys):
    """--soak briefly at low concurrency: every kind of the mix is sent, no valid request fails, every oversized
    body is a 413, the KV blocks drain to 0 and the server's RSS is read from /metrics."""
    rc = main(
        ["serve-bench", "--soak", "--url", spec_server.url, "--concurrency", "4", "--duration", "5"]
        + [
            "--max-tokens",
            "8",
            "--timeout",
            "30",
            "--mix",
            "stream=3,plain=2,logprobs=2,stop=2,chat=2,disconnect=2,oversized=2",
        ]
        + ["--oversize-bytes", str(spec_server.config.max_request_bytes + 1024)]
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["ok"], res
    assert res["valid_errors"] == 0 and res["valid_ok"] > 0, res["error_samples"]
    assert set(res["sent"]) == {"stream", "plain", "logprobs", "stop", "chat", "disconnect", "oversized"}, res["sent"]
    assert res["oversized_rejected"] == res["oversized_sent"] > 0 and res["disconnects"] > 0, res
    assert res["kv_blocks_used_after"] == 0 and res["requests_outstanding_after"] == 0, res
    assert res["rss_before_bytes"] > 0 and res["rss_after_bytes"] > 0, res
