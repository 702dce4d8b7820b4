"""Per-proposal cost and memory of the suffix drafter beside the n-gram drafter (no model).

    python benchmarks/suffix_micro.py [--store-tokens 262144] [--request-tokens 300]

Fills the suffix drafter's global tree with `--store-tokens` tokens of earlier requests (random
tokens of a 49,152 vocabulary, one request per `--request-tokens`, plus repeats of one template
so that proposals hit), then times, per row, at context lengths 256 / 1024 / 2048: the n-gram
drafter's proposal, the suffix drafter's (request tree + global tree) for a context that misses
and for one that hits the global tree; then the insert of finished requests into the full store
(`--inserts` of them, the evictions and index upkeep they cause included: mean, median, p99 and
the worst one, which is what one engine step may wait for). Prints a table and the memory the
drafter reports.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specrouter.drafters.ngram import NgramDrafter
from specrouter.drafters.suffix import SuffixConfig, SuffixDrafter


def per_call(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def insert_times(suffix: SuffixDrafter, rng, vocab: int, length: int, count: int) -> np.ndarray:
    """(count,) seconds of each of `count` inserts of a random `length`-token request."""
    reqs = [rng.integers(0, vocab, length).tolist() for _ in range(count)]
    out = np.empty(count)
    for i, req in enumerate(reqs):
        t0 = time.perf_counter()
        suffix.observe_request(req)
        out[i] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store-tokens", type=int, default=262_144)
    ap.add_argument("--request-tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--inserts", type=int, default=400)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    V = 49_152
    suffix = SuffixDrafter(SuffixConfig(max_tokens=args.store_tokens))
    template = rng.integers(0, V, args.request_tokens).tolist()
    filled = 0
    while filled < args.store_tokens:
        req = template if filled % (10 * args.request_tokens) == 0 else rng.integers(0, V, args.request_tokens).tolist()
        suffix.observe_request(req)
        filled += len(req)
    ngram = NgramDrafter()
    print(f"{'context':>8} {'ngram us':>9} {'suffix miss us':>15} {'suffix hit us':>14}")
    for L in (256, 1024, 2048):
        miss = rng.integers(0, V, L).tolist()
        hit = rng.integers(0, V, L - 40).tolist() + template[:40]
        t_ng = per_call(lambda: ngram.propose([miss], 16), args.repeats)
        t_miss = per_call(lambda: suffix.propose([miss], 16), args.repeats)
        t_hit = per_call(lambda: suffix.propose([hit], 16), args.repeats)
        print(f"{L:>8} {t_ng * 1e6:>9.0f} {t_miss * 1e6:>15.0f} {t_hit * 1e6:>14.0f}")
    assert suffix.propose([hit], 16)[1].item() == 16  # the template is found
    t_ins = insert_times(suffix, rng, V, args.request_tokens, args.inserts)  # (inserts,)
    mem = suffix.memory()
    print(f"insert of a {args.request_tokens}-token request into a full store ({args.inserts} inserts): "
          f"mean {t_ins.mean() * 1e3:.3f} ms, median {np.median(t_ins) * 1e3:.3f} ms, "
          f"p99 {np.quantile(t_ins, 0.99) * 1e3:.3f} ms, max {t_ins.max() * 1e3:.3f} ms")
    print(f"memory: {mem.tokens} tokens of {mem.requests} requests, {mem.bytes / 2**20:.1f} MiB "
          f"({mem.bytes / max(mem.tokens, 1):.1f} bytes/token), {mem.evicted_requests} evicted")


if __name__ == "__main__":
    main()
