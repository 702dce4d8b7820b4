"""The honest single-stream baseline where kernel paths differ at one token (issue 26).

On a Sapphire Rapids-class Xeon the `amx` path verifies k tokens nearly for free, but its
1-token step is slower than the `avx2` path's (docs/kernels.md), so target-only on the process's
path is not the fastest plain decoding on that machine. This script runs, in one process, in turns
per request on the same prompts (the mixed stream of `specrouter bench`):
- SpecRouter on the process's kernel path (the router, the default pool);
- target-only on the same path (the reference its greedy output must equal, checked);
- target-only with the target loaded on `--plain-path` (a second copy of the target's weights,
  `load_llama_runner(kernels=...)`): plain decoding on the other path, its own pool view.
It prints tokens/s of each and SpecRouter's ratio over both baselines. `specrouter bench` and
`specrouter demo` now do this themselves (bench/plain_path.py: target-only on the path with the
fastest 1-token step, the process's path kept as the greedy reference); this script stays as the
three-row check.

    python benchmarks/fastest_plain.py [--plain-path avx2] [--prompts-per-type 3] [--max-new-tokens 64]

Not a test: timings depend on the machine and on whoever else shares its cores.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from specrouter import SpecRouter
from specrouter.bench.workloads import mixed_stream
from specrouter.config import EngineConfig, SpecRouterConfig
from specrouter.models.runners.kernels import kernel_path
from specrouter.models.runners.llama import load_llama_runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plain-path", default="avx2", help="kernel path of the second target-only (default avx2)")
    ap.add_argument("--prompts-per-type", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = SpecRouter.from_pretrained("default")  # the pool and its router, on the process's kernel path
    pool = loaded.pool
    config = SpecRouterConfig(engine=EngineConfig(prefix_cache=False))  # as the bench's systems: no parked slots
    sr = SpecRouter(pool.with_fresh_drafters(), loaded.router, config)
    ref = pool.runners[pool.target]
    other = load_llama_runner(ref.checkpoint_dir, name=pool.target, dtype=ref.dtype,
                              num_slots=ref.num_slots, max_len=ref.max_len, kernels=args.plain_path)
    plain_here = SpecRouter(pool.with_fresh_drafters(), config=config)
    plain_other = SpecRouter(pool.target_only_view(other), config=config)
    here, there = f"target-only {kernel_path()}", f"target-only {args.plain_path}"
    n = args.max_new_tokens
    systems = {here: lambda q: plain_here.generate(q.prompt, chat=q.chat, max_new_tokens=n, chain=(pool.target,))[0],
               there: lambda q: plain_other.generate(q.prompt, chat=q.chat, max_new_tokens=n, chain=(pool.target,))[0],
               "SpecRouter": lambda q: sr.generate(q.prompt, chat=q.chat, max_new_tokens=n)[0]}
    requests = mixed_stream(args.prompts_per_type)
    for f in systems.values():  # warm-up, not timed
        f(requests[0])
    tokens, seconds = dict.fromkeys(systems, 0), dict.fromkeys(systems, 0.0)
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for i, q in enumerate(requests):
        outs = {}
        for name in (list(systems) if i % 2 == 0 else list(reversed(systems))):  # turns, order alternating
            t0 = time.perf_counter()
            res = systems[name](q)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(res.token_ids)
            outs[name] = res.token_ids
        if outs["SpecRouter"] != outs[here]:
            raise SystemExit(f"request {i} ({q.kind}): SpecRouter's greedy output differs from {here}'s")
    rate = {name: tokens[name] / seconds[name] for name in systems}
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; greedy outputs of SpecRouter = {here}: all {len(requests)}")
    for name, r in rate.items():
        print(f"{name:>24}: {r:6.1f} tok/s")
    print(f"SpecRouter / {here}: {rate['SpecRouter'] / rate[here]:.3f}")
    print(f"SpecRouter / {there}: {rate['SpecRouter'] / rate[there]:.3f}")
    print(f"{there} / {here}: {rate[there] / rate[here]:.3f}")


if __name__ == "__main__":
    main()
