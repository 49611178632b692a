"""`refengine serve` and `refengine serve-bench` subcommands (registered by refengine/cli.py)."""

from __future__ import annotations


def add_server_parsers(sub) -> None:
    from refengine.server.loadtest import add_serve_bench_parser
    from refengine.server.serve import add_serve_parser

    add_serve_parser(sub)
    add_serve_bench_parser(sub)
