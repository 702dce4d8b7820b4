"""The side-by-side benchmark (`specrouter bench`, `benchmarks/bench.py`): SpecRouter against
target-only decoding, transformers generate and assisted generation, every static chain at its
best k, and the per-request oracle, interleaved in one process.

workloads.py: the requests; systems.py: how each system runs and is timed; slowdown.py: the
scripted slowdown; run.py: the loop, static-k selection, the oracle; report.py: JSON, markdown,
goals; plots.py: PNGs.
"""

from specrouter.bench.run import BenchConfig, GreedyMismatchError, run_bench

__all__ = ["BenchConfig", "GreedyMismatchError", "run_bench"]
