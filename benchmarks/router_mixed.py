"""Adaptive routing vs every static chain vs the per-request oracle on a mixed stream of
extraction / repetition prompts (n-gram drafting wins) alternating with open-ended chat
requests (plain decoding or a model draft wins); greedy, outputs checked identical.

A thin preset of the benchmark harness (`specrouter.bench`, see benchmarks/bench.py):

    python benchmarks/router_mixed.py [--threads N] [--rounds R] [--models d t] [--ks 2 4 8]

is `specrouter bench --workloads mixed --kinds extraction chat --mixed-block 1
--prompts-per-type 5 --temperatures 0 --hf none --no-slowdown --out-dir bench-out/router_mixed`
(any other `specrouter bench` flag is passed through).
"""

import argparse
import sys

from specrouter.cli.main import main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the stream")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="k of static chains")
    args, rest = ap.parse_known_args()
    sys.exit(main(["bench",
        "--workloads", "mixed", "--kinds", "extraction", "chat", "--mixed-block", "1",
        "--prompts-per-type", "5", "--temperatures", "0", "--hf", "none", "--no-slowdown",
        "--out-dir", "bench-out/router_mixed", "--repeat", str(args.rounds),
        "--max-new-tokens", str(args.max_new_tokens), "--ks", *map(str, args.ks), *rest,
    ]))
