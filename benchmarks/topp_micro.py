"""Micro: scaled_logits / choose_tokens / choose_at with top-k / top-p / min-p (float32, V 49152).

Usage: PYTHONPATH=src python benchmarks/topp_micro.py [--threads 2] [--reps 30] [--sort | --torch]
(--sort: the vocabulary sort, the reference; --torch: the torch candidate path; default: the native cut where built)
Logits: a peaked LM-like row (a Gumbel-ish spread scaled to ~8 nats), temperature 0.7.
"""
from __future__ import annotations

import argparse
import time

import torch

from specrouter.config import SamplingParams
from specrouter.decoding import sampling
from specrouter.decoding.noise import position_keys
from specrouter.decoding.sampling import SamplingTensors, choose_at, choose_tokens, scaled_logits


def timeit(fn, reps):
    fn()
    fn()
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    best.sort()
    return best[len(best) // 2] * 1e6  # median us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sort", action="store_true", help="force the sort path (reference)")
    ap.add_argument("--torch", action="store_true", help="the torch candidate path (not the native cut)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.sort:
        sampling.FORCE_SORT = True
    if a.torch:
        sampling.NATIVE = False
    V = 49152
    g = torch.Generator().manual_seed(0)
    controls = [("top_p 0.9", dict(top_p=0.9)), ("top_p 0.95", dict(top_p=0.95)), ("top_k 40", dict(top_k=40)),
                ("top_k 50", dict(top_k=50)), ("k50 p0.9", dict(top_k=50, top_p=0.9)),
                ("p0.9 minp0.05", dict(top_p=0.9, min_p=0.05)), ("k40 p0.95 minp0.05", dict(top_k=40, top_p=0.95, min_p=0.05))]
    print(f"{'control':22s} B M  scaled_logits  choose_tokens  choose_at   (median us, {a.threads} threads)")
    for name, kw in controls:
        for B, M in [(1, 1), (4, 1), (1, 5), (4, 5)]:
            logits = torch.randn(B, M, V, generator=g) * 2.5
            logits[..., :200] += 6.0  # a head of likely tokens
            st = SamplingTensors.from_params([SamplingParams(temperature=0.7, **kw) for _ in range(B)])
            keys = position_keys(torch.arange(B)[:, None] * 7 + 1, torch.arange(M)[None, :] + 10)
            t1 = timeit(lambda: scaled_logits(logits, st), a.reps)
            t2 = timeit(lambda: choose_tokens(logits, st, keys), a.reps)
            t3 = timeit(lambda: choose_at(logits, st, list(range(B)), [b * 7 + 1 for b in range(B)],
                                          [10 + m for b in range(B) for m in range(M)]), a.reps)
            print(f"{name:22s} {B} {M}  {t1:12.0f}  {t2:13.0f}  {t3:10.0f}")


if __name__ == "__main__":
    main()
