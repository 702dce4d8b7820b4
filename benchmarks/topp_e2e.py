"""End to end: top-p / top-k through the native cut (kernels/cut.h) vs the torch candidate path
(sampling.NATIVE = False, penalties on numpy: processors.NATIVE = False; `--against sort`: the sort path,
sampling.FORCE_SORT), each SpecRouter on its own pool view (`Pool.with_fresh_drafters()`), target-only and
SpecRouter side by side in one process (order rotated per request), the bench's prompts, optionally
with penalties. Prints tokens/s per request and summed, and whether each pair's tokens are equal.

    python benchmarks/topp_e2e.py [--temperature 0.7] [--top-p 0.9] [--top-k 0] [--min-p 0] [--workload mixed]
        [--prompts-per-type 2] [--max-new-tokens 64] [--against torch|sort]
        [--presence-penalty P] [--frequency-penalty F] [--repetition-penalty R]
"""

from __future__ import annotations

import argparse

import torch

from specrouter.api import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.bench.systems import AdaptiveSystem, Decoding, NativeSystem
from specrouter.decoding import processors, sampling
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.setup import load_or_sweep_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--against", choices=("torch", "sort"), default="torch")
    for name in ("presence", "frequency", "repetition"):
        ap.add_argument(f"--{name}-penalty", type=float, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--prompts-per-type", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    controls = tuple((n, v) for n, v in (("top_p", args.top_p), ("top_k", args.top_k), ("min_p", args.min_p))
                     if v not in (1.0, 0))
    controls += tuple((f"{n}_penalty", v) for n in ("presence", "frequency", "repetition")
                      if (v := getattr(args, f"{n}_penalty")) is not None)
    ref = args.against
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    profile = load_or_sweep_profile(pool, progress=False)
    target = NativeSystem(pool, "target-only", (pool.target,), None)
    systems = {f"target-only/{ref}": (target, True), "target-only/native": (target, False),
               f"SR/{ref}": (AdaptiveSystem(pool.with_fresh_drafters(), f"sr-{ref}", profile=profile, progress=False), True),
               "SR/native": (AdaptiveSystem(pool.with_fresh_drafters(), "sr-native", profile=profile, progress=False), False)}
    for s, _ in systems.values():
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))
        s.reset()
    names = list(systems)
    cfg = BenchConfig(workloads=(args.workload,), prompts_per_type=args.prompts_per_type,
                      temperatures=(args.temperature,), max_new_tokens=args.max_new_tokens, slowdown=False,
                      hf="none", peers=False, controls=controls)
    scenario = build_scenarios(cfg)[0]
    total = {n: [0, 0.0] for n in names}
    same = {"target-only": 0, "SR": 0, "target-only vs SR": 0}
    for i, req in enumerate(scenario.workload.requests):
        ids = sr.encode(req.prompt, chat=req.chat)
        row, toks = {}, {}
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            system, against = systems[n]
            if against:
                setattr(sampling, "FORCE_SORT" if ref == "sort" else "NATIVE", ref == "sort")
                processors.NATIVE = False  # the penalties on numpy too (the native kernel's reference)
            try:
                out = system.run(ids, Decoding(args.temperature, cfg.max_new_tokens, cfg.seed + i, controls))
            finally:
                sampling.FORCE_SORT, sampling.NATIVE, processors.NATIVE = False, True, True
            total[n][0] += len(out.token_ids)
            total[n][1] += out.seconds
            row[n], toks[n] = len(out.token_ids) / out.seconds, list(out.token_ids)
        same["target-only"] += toks[f"target-only/{ref}"] == toks["target-only/native"]
        same["SR"] += toks[f"SR/{ref}"] == toks["SR/native"]
        same["target-only vs SR"] += toks["target-only/native"] == toks["SR/native"]
        print(f"#{i} {req.kind:10s} " + " ".join(f"{n} {v:.1f}" for n, v in row.items()), flush=True)
    n_req = len(scenario.workload.requests)
    print(f"t={args.temperature:g} {controls} total tokens/s: "
          + " ".join(f"{n} {t / s:.1f}" for n, (t, s) in total.items()), flush=True)
    print("requests with equal tokens: " + ", ".join(f"{k} {v}/{n_req}" for k, v in same.items()), flush=True)


if __name__ == "__main__":
    main()
