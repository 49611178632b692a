"""`refengine bench` (cli.py): runs (run.py), engines loaded (loading.py), one mode at a time (suite.py) or
side by side (paired.py), prompt sets (prompts.py), the table (report.py), the HF peer (peer_hf.py), the plot
(plot.py); the cell matrix (--sample-cells: matrix_cli.py, cells.py, matrix.py, verdict.py)."""

from refengine.bench.cli import add_bench_parser, bench
from refengine.bench.floors import measure_copy_bandwidth
from refengine.bench.run import BenchError

__all__ = ["BenchError", "add_bench_parser", "bench", "measure_copy_bandwidth"]
