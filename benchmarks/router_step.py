"""The router's time per engine step (issue 14): `Router.plan_batch` over every running row, as
the engine calls it each step, on a scripted four-model pool (router_decide.py's costs and
acceptances) whose evidence keeps moving: every step's outcomes (iid acceptance) and forward
timings (with multiplicative noise) are observed, rows finish and new ones start.

    python benchmarks/router_step.py [--rows 1 4 8] [--steps 600] [--noise 0.05]

Only the router's calls are timed: plan_batch (its decide() calls included) and, apart,
observe_step (decide()'s own share from its DecisionEvents). Prints the medians per step and the decision cache's hit rate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from router_decide import ALPHAS, COSTS, build_router

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test fixtures
from fixtures import iid_cycle  # noqa: E402

from specrouter.records.routing import StepReport
from specrouter.router.policy import ForwardRecord, RowContext, RowOutcome

L0, LENGTH = 256, 512  # a row's prompt, and the tokens it generates before a new one replaces it


def outcome(rng: random.Random, seq_id: int, chain, k: int, L: int) -> tuple[RowOutcome, int]:
    """One row's cycle of the iid model: (its RowOutcome, tokens committed)."""
    drafted, accepted = iid_cycle(rng, chain, k, ALPHAS, ngram_hit=0.3)
    if len(chain) == 1:
        return RowOutcome(seq_id, tuple(chain), 0, drafted, accepted, True, L), 1
    return RowOutcome(seq_id, tuple(chain), k, drafted, accepted, True, L), accepted[-1] + 1


def forwards(rng: random.Random, plans, L: int, noise: float) -> list[ForwardRecord]:
    """Every model's forward of the step (padded to the widest row), timed with noise."""
    widths: dict[str, int] = {}
    rows: dict[str, int] = {}
    for chain, k in plans:
        for j, m in enumerate(chain):
            w = 1 if len(chain) == 1 else (k if j == 0 else k + j)
            widths[m], rows[m] = max(widths.get(m, 0), w), rows.get(m, 0) + 1
    out = []
    for m, w in widths.items():
        b = rows[m]
        seconds = COSTS[m](b, w, L) * rng.lognormvariate(0.0, noise)
        out.append(ForwardRecord(m, b, w, L, seconds))
    return out


def run(b: int, steps: int, noise: float, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    router = build_router()
    lens = {s: L0 + 37 * s for s in range(b)}
    next_id = b
    plan_us, decide_us, observe_us = [], [], []
    for _ in range(steps):
        rows = [RowContext(s, L, batch_size=b, remaining=L0 + LENGTH + 64 - L) for s, L in lens.items()]
        last = router.events[-1] if router.events else None
        t0 = time.perf_counter()
        decisions = router.plan_batch(rows).decisions
        plan_us.append(1e6 * (time.perf_counter() - t0))
        fresh = []  # this step's decisions only (a held step makes none)
        for e in reversed(router.events):
            if e is last:
                break
            fresh.append(e)
        decide_us.append(1e6 * sum(e.decide_seconds for e in fresh))
        plans = [(d.chain, d.k) for d in decisions]
        results = [outcome(rng, r.seq_id, c, k, r.context_len) for r, (c, k) in zip(rows, plans)]
        L = sum(lens.values()) // b
        fwd = forwards(rng, plans, L, noise)
        seconds = sum(f.seconds for f in fwd)
        t0 = time.perf_counter()
        router.observe_step(StepReport([o for o, _ in results], fwd, seconds + 3e-4, seconds, any(k for _, k in plans)))
        observe_us.append(1e6 * (time.perf_counter() - t0))
        for (o, committed) in results:
            lens[o.seq_id] += committed
            if lens[o.seq_id] >= L0 + LENGTH:
                router.finish_request(o.seq_id)
                del lens[o.seq_id]
                lens[next_id], next_id = L0, next_id + 1
    stats = getattr(router, "cache_stats", None)
    hit = stats.hit_rate if stats is not None else float("nan")
    return {"plan": statistics.median(plan_us), "decide": statistics.median(decide_us),
            "observe": statistics.median(observe_us), "hit": hit}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="batch sizes")
    ap.add_argument("--steps", type=int, default=600, help="engine steps per batch size")
    ap.add_argument("--noise", type=float, default=0.05, help="sigma of the forwards' log-normal timing noise")
    args = ap.parse_args(argv)
    for b in args.rows:
        r = run(b, args.steps, args.noise)
        print(f"b={b}: plan_batch median {r['plan']:.0f} us/step ({r['plan'] / b:.0f} us/row), "
              f"of which decide() {r['decide']:.0f} us/step; observe_step median {r['observe']:.0f} us/step, decision cache hit rate {r['hit']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
