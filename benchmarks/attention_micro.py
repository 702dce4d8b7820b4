"""Micro-benchmark: one layer's native attention (kernels/rowinv.cpp `rope_attention`: RoPE of q
and k, the cache write, softmax(q k) v per query) at SmolLM2-135M's widths (9 query heads, 3 KV
heads, head size 64) after a 128-token context, for n = 1, 2, 3, 5, 9, 17 new tokens of one
sequence (a verification of n - 1 drafted tokens), float32 and bfloat16 caches.

Each cell is the min over `--rounds` rounds of the median of `--iters` calls; every n and
precision takes its turn in each round (drift on shared cores hits them alike). The same cache
start every call (the write lands on the same positions), so the cost is that of a step.

    python benchmarks/attention_micro.py [--threads 2] [--iters 200] [--rounds 5]

To compare two builds, run the script from each tree in turns (PYTHONPATH=<tree>/src): each
checkout builds its own extension. Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specrouter.models.runners.kernels import kernel_path, rowinv
from specrouter.models.runners.rope import rope_tables

TOKENS = (1, 2, 3, 5, 9, 17)
NH, NKV, D, CONTEXT = 9, 3, 64, 128


def calls(dtype: torch.dtype) -> dict:
    """{n: a rope_attention call of n new tokens at position CONTEXT} on caches of `dtype`."""
    ops = rowinv()
    g = torch.Generator().manual_seed(0)
    P = CONTEXT + max(TOKENS)
    cos, sin = rope_tables(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 1.0, P, torch.float32)
    kc = torch.randn(1, NKV, P, D, generator=g).to(dtype)  # (slots, KV heads, positions, D)
    vc = torch.randn(1, NKV, P, D, generator=g).to(dtype)
    one = torch.zeros(1, dtype=torch.long)
    out = {}
    for n in TOKENS:
        qkv = (torch.randn(1, n, NH + 2 * NKV, D, generator=g) * 0.3).to(dtype)  # (B, T, heads, D)
        starts, nums = torch.tensor([CONTEXT]), torch.tensor([n])
        out[n] = lambda qkv=qkv, starts=starts, nums=nums: ops.rope_attention(qkv, NH, cos, sin, kc, vc, one * 0,
                                                                              starts, nums)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200, help="calls per cell per round (median)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if rowinv() is None:
        raise SystemExit("the native kernels do not run here")
    systems = {name: calls(dt) for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for n in TOKENS:
            for name, fns in systems.items():
                for _ in range(5):
                    fns[n]()
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    fns[n]()
                    times.append(time.perf_counter() - t0)
                best[(name, n)] = min(best.get((name, n), float("inf")), 1e6 * statistics.median(times))
    print(f"rope_attention, {NH}/{NKV} heads, D {D}, context {CONTEXT}, {args.threads} threads, kernel path "
          f"{kernel_path()} (attention is the same AVX2 code on every native path); us per call (one layer)")
    for name in systems:
        print(f"{name}: " + ", ".join(f"n={n} {best[(name, n)]:.1f}" for n in TOKENS))


if __name__ == "__main__":
    main()
