"""`refengine bench` (cli.py): runs (run.py), prompt sets (prompts.py), the table (report.py), the HF peer
(peer_hf.py) and the plot (plot.py)."""

from refengine.bench.cli import add_bench_parser, bench
from refengine.bench.run import BenchError, measure_copy_bandwidth

__all__ = ["BenchError", "add_bench_parser", "bench", "measure_copy_bandwidth"]
