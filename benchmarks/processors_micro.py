"""Micro-benchmark: the logits processors' seconds per call (issue 31), the fast path
(decoding/processors.py: every row's penalties at every position in one flat pass, the committed
history kept on a PenaltyMemo across calls) against the per-call reference it replaced
(tests/processors_reference.py), and against a call with no processor (the float32 copy only).

SmolLM2's vocabulary (49152), a 200-token prompt, 40 generated tokens drawn from it, a draft
path of 8 tokens; presence 0.5 and frequency 0.3; B rows of G positions: G = 1 is a draft step
(offset 2), G = 5 / 9 a verifier over 4 / 8 candidates. Both outputs are checked equal bit for
bit before timing.

    python benchmarks/processors_micro.py [--iters 300] [--threads 2] [--cold]

`--cold`: before each timed call, stream a 64 MB buffer and run a small matmul (what a model
forward does to the caches between two processor calls in the engine), and report medians.
The engine's figure is the cold one (~3-8x the warm loop's).

Not a test: timings depend on the machine and on whoever else shares its cores.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import processors_reference as ref  # noqa: E402

from specrouter.bench.provenance import describe, provenance  # noqa: E402
from specrouter.config import SamplingParams  # noqa: E402
from specrouter.decoding import processors as fast  # noqa: E402

V = 49152


class Flush:
    """Evicts the caches as a model forward would: streams 64 MB and runs a small matmul."""

    def __init__(self):
        self.buffer = torch.ones(8 << 20, dtype=torch.float64)
        self.weight = torch.randn(2048, 2048)

    def __call__(self) -> None:
        self.buffer.sum()
        torch.mm(self.weight[:8], self.weight)


def timeit(fn, iters: int, flush: Flush | None = None) -> float:
    """Microseconds of fn() after one warm-up call: the mean over iters calls in a loop, or
    with `flush`, the median of iters calls each after flush() (not timed)."""
    fn()
    if flush is None:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    times = []
    for _ in range(iters):
        flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each timed call (medians)")
    args = ap.parse_args()
    flush = Flush() if args.cold else None
    torch.set_num_threads(args.threads)
    print(describe(provenance()))
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(200)]
    tokens = prompt + [rng.choice(prompt) for _ in range(40)]
    path = [rng.randrange(V) for _ in range(8)]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)
    stops = frozenset({2})
    print(f"{'rows':>4} {'G':>2} {'reference us':>13} {'fast us':>8} {'no processor us':>16} {'speed-up':>9}")
    for B in (1, 4, 16):
        for G, offset in ((1, 2), (5, 0), (9, 0)):
            logits = torch.randn(B, G, V)
            memos = [fast.PenaltyMemo() for _ in range(B)]
            rows_fast = [fast.RowHistory(params, tokens, len(prompt), stops, path, offset, memo=m) for m in memos]
            rows_ref = [ref.RowHistory(params, tokens, len(prompt), stops, path, offset)] * B
            rows_none = [fast.RowHistory(SamplingParams(), tokens, len(prompt), stops, path, offset)] * B
            got, want = fast.process_rows(logits, rows_fast), ref.process_rows(logits, rows_ref)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "fast != reference"
            t_ref = timeit(lambda: ref.process_rows(logits, rows_ref), args.iters, flush)
            t_fast = timeit(lambda: fast.process_rows(logits, rows_fast), args.iters, flush)
            t_none = timeit(lambda: fast.process_rows(logits, rows_none), args.iters, flush)
            print(f"{B:>4} {G:>2} {t_ref:>13.1f} {t_fast:>8.1f} {t_none:>16.1f} {t_ref / t_fast:>8.1f}x")
    print(describe(provenance()))


if __name__ == "__main__":
    main()
