"""Micro-benchmark of the router's similarity signal (issues 27, 28): `level_tv` natively
(kernels/tv.cpp through decoding/tv.py `tv_rows`) against the torch path (`level_tv_torch`),
and what D_TV costs a step in the engine with each.

    python benchmarks/tv_micro.py [--threads 2] [--iters 300] [--engine] [--prompts 4] [--max-new-tokens 48]

Micro: SmolLM2's vocabulary (49152), one row of 1 or 2 candidate positions (the executor's
`tv_positions` is 2), logits float32 as the runners return them (bfloat16 models included),
temperature 0.7 alone, with min_p 0.05, with top_p 0.9, with top_k 50 (a greedy row's line went
with greedy rows' D_TV, prune23: sampled rows only); "warm": the mean of a loop, "cold": the median of calls each after streaming 64 MB
and a small matmul (what a model forward does to the caches in between).

`--engine`: the default pool, a router measuring D_TV in every step (`tv_every=1`), mixed
prompts at temperature 0.7, each decoded with the native D_TV and with the torch path in turn
(one process): the executor's `tv_seconds` per step that measured, and tokens/s.

Not a test: timings depend on the machine and on whoever else shares its cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from specrouter.config import SamplingParams
from specrouter.decoding import tv as tvmod
from specrouter.decoding.sampling import SamplingTensors
from specrouter.decoding.tv import level_tv_torch, tv_rows

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
    """Microseconds of fn(): the mean of a loop, or with `flush` the median of calls after it."""
    fn()
    if flush is None:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    times = []
    for _ in range(max(iters // 3, 5)):
        flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def micro(iters: int) -> None:
    flush = Flush()
    g = torch.Generator().manual_seed(0)
    native_ops = tvmod._native_ops
    for n in (1, 2):
        d = torch.randn(1, n, V, generator=g) * 3
        v = torch.randn(1, n + 1, V, generator=g) * 3
        num = torch.tensor([n])
        drafts = [list(d[0].clone())]
        for label, p in [("t=0.7", SamplingParams(temperature=0.7)),
                         ("t=0.7 min_p=0.05", SamplingParams(temperature=0.7, min_p=0.05)),
                         ("t=0.7 top_p=0.9", SamplingParams(temperature=0.7, top_p=0.9)),
                         ("t=0.7 top_k=50", SamplingParams(temperature=0.7, top_k=50))]:
            st = SamplingTensors.from_params([p])
            row = []
            for cold in (None, flush):
                row.append(timeit(lambda: level_tv_torch(d, v, num, st), iters, cold))
                row.append(timeit(lambda: tv_rows(drafts, v, [0], st, [0]), iters, cold))
            print(f"{n} position{'s' if n > 1 else ' '} {label:18s} warm: torch {row[0]:7.1f} us, native {row[1]:6.1f} us"
                  f" | cold: torch {row[2]:7.1f} us, native {row[3]:6.1f} us")
    tvmod._native_ops = native_ops


def engine(prompts: int, max_new_tokens: int) -> None:
    import copy

    from specrouter.api import SpecRouter
    from specrouter.bench.workloads import mixed_stream
    from specrouter.config import RouterConfig
    from specrouter.models.default_pool import default_pool_paths
    from specrouter.router.policy import Router
    from specrouter.router.setup import load_or_sweep_profile

    base = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = base.pool
    profile = load_or_sweep_profile(pool, progress=False)
    cfg = RouterConfig()
    cfg = dataclasses.replace(cfg, similarity=dataclasses.replace(cfg.similarity, tv_every=1))
    requests = mixed_stream(max(1, prompts // 4), 2)[:prompts]
    ids = [base.encode(r.prompt, chat=r.chat) for r in requests]
    native_ops = tvmod._native_ops
    modes = {"native": native_ops, "torch": lambda: None}
    cost = {m: {"tv": 0.0, "steps": 0, "measured": 0, "wall": 0.0, "tokens": 0, "seconds": 0.0, "each": []}
            for m in modes}
    systems = {}
    for m in modes:
        router = Router.from_pool(pool, copy.deepcopy(profile), config=cfg)
        observe = router.observe_step

        def counted(report, m=m, observe=observe):
            c = cost[m]
            c["tv"] += report.tv_seconds
            c["steps"] += 1
            c["measured"] += report.tv_seconds > 0
            if report.tv_seconds > 0:
                c["each"].append(report.tv_seconds)
            c["wall"] += report.wall_time
            observe(report)
        router.observe_step = counted
        systems[m] = SpecRouter(pool.with_fresh_drafters(), router)
    systems["native"].generate(ids[0], max_new_tokens=8)  # first forwards allocate
    for i, x in enumerate(ids):
        for j in range(len(modes)):
            m = list(modes)[(i + j) % len(modes)]
            tvmod._native_ops = modes[m]
            t0 = time.perf_counter()
            res = systems[m].generate(x, max_new_tokens=max_new_tokens, temperature=0.7, seed=i)[0]
            cost[m]["seconds"] += time.perf_counter() - t0
            cost[m]["tokens"] += len(res.token_ids)
    tvmod._native_ops = native_ops
    for m, c in cost.items():
        print(f"engine {m:6s}: D_TV {1e6 * c['tv'] / max(c['measured'], 1):7.1f} us per measuring step "
              f"(median {1e6 * statistics.median(c['each'] or [0]):.1f}; {c['measured']} of {c['steps']} steps), "
              f"{c['tv'] / max(c['wall'], 1e-9):.2%} of the steps' time, "
              f"{c['tokens'] / c['seconds']:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
    print(f"{args.threads} threads, load average {' '.join(load)}, native kernels: {tvmod._native_ops() is not None}")
    micro(args.iters)
    if args.engine:
        engine(args.prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
