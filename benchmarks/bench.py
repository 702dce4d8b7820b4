"""The side-by-side benchmark: `python benchmarks/bench.py [flags]` == `specrouter bench [flags]`.

SpecRouter against target-only decoding (native runner), transformers `generate()` and assisted
generation, every static chain at its best k, and the per-request oracle, on code, prose, chat,
extraction and a mixed stream, greedy and t=0.7, plus a scripted slowdown of one model; all
interleaved request by request in one process. Writes bench.json, bench.md and PNGs to
--out-dir (default bench-out/) and prints the tables. Greedy outputs of the static chains and
SpecRouter are checked identical to target-only (exit status 2 otherwise).

    python benchmarks/bench.py --quick --threads 1     # smoke run, < 3 min on 2 cores
    python benchmarks/bench.py --threads 2             # the full run
    python benchmarks/bench.py --help                  # every flag

The logic lives in `specrouter.bench` (workloads, systems, run, report, plots).
"""

import sys

from specrouter.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
