"""How long `Router.decide()` takes for a four-model pool (n-gram, two drafts, target: 8 chains
x 16 draft lengths), the claim being "well under 1 ms" per call (the router decides for every
row every cycle, and its time is charged to every plan: tests/test_router.py checks that).

    python benchmarks/router_decide.py [--calls 2000] [--rows 4] [--limit-us 1000]

A scripted pool (known costs T_M(b, t, L) and acceptances fed as observed trials, no torch
models) so that only the router is timed. Prints the median and 90th percentile per call and
exits 1 when the median is over --limit-us.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specrouter.router.policy import Router, RowContext
from specrouter.router.profile import CostProfile
from specrouter.router.similarity import GREEDY

COSTS = {  # seconds of one forward: (b rows, t new tokens, context L)
    "ngram": lambda b, t, L: 3e-5 * b + 1e-6 * t * b,
    "d1": lambda b, t, L: 0.002 + 0.0002 * b * t + 1e-7 * L * b,
    "d2": lambda b, t, L: 0.008 + 0.0008 * b * t + 4e-7 * L * b,
    "T": lambda b, t, L: 0.040 + 0.0025 * b * t + 2e-6 * L * b,
}
ALPHAS = {("d1", "T"): 0.65, ("d2", "T"): 0.85, ("d1", "d2"): 0.9,
          ("ngram", "T"): 0.5, ("ngram", "d1"): 0.5, ("ngram", "d2"): 0.5}
SIZES = {"d1": 10_000_000, "d2": 60_000_000, "T": 400_000_000}


def build_router() -> Router:
    profile = CostProfile()
    for name, fn in COSTS.items():
        profile.set_function(name, fn)
    router = Router(list(COSTS), "T", profile, model_free={"ngram"}, sizes=SIZES)
    for pair, alpha in ALPHAS.items():  # 200 observed trials per pair
        router.similarity.observe_acceptance(pair, GREEDY, 200 * alpha, 200 * (1 - alpha))
    router.similarity.observe_hits("ngram", 30, 100)
    return router


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="decide() calls timed")
    ap.add_argument("--rows", type=int, default=4, help="rows decided in turn (batch size b)")
    ap.add_argument("--limit-us", type=float, default=1000.0, help="exit 1 when the median is above")
    args = ap.parse_args(argv)
    router = build_router()
    rows = [RowContext(s, 256 + 7 * s, batch_size=args.rows) for s in range(args.rows)]
    for r in rows:  # warm-up: the first decision of a row builds its cost rows
        router.decide(r)
    times = []
    for i in range(args.calls):
        t0 = time.perf_counter()
        router.decide(rows[i % args.rows])
        times.append(time.perf_counter() - t0)
    us = sorted(1e6 * t for t in times)
    median, p90 = statistics.median(us), us[int(0.9 * (len(us) - 1))]
    print(f"decide(): median {median:.0f} us, p90 {p90:.0f} us per call "
          f"({len(router.chains)} chains x {router.config.k_max} k, {args.rows} rows; "
          f"limit {args.limit_us:.0f} us)")
    return 0 if median <= args.limit_us else 1


if __name__ == "__main__":
    sys.exit(main())
