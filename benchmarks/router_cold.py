"""A cold router against a warm one on the mixed stream, D_TV on and off side by side (issue 27).

    python benchmarks/router_cold.py [--threads 2] [--per-type 6] [--after 16] [--temperature 0]

One process, the embedded default pool, the machine's cost profile (present: swept before).
Systems, each on its own pool view (`Pool.with_fresh_drafters()`), interleaved request by
request in a rotating order: target-only, SpecRouter with D_TV measured, SpecRouter learning from
acceptance counts only (`SimilarityConfig(measure_tv=False)`). The mixed stream (types alternate
every 2 requests, `--per-type` prompts of each) runs twice: pass 1 with fresh routers (cold:
nothing learned), pass 2 with the same routers (warm), each pass on fresh learning drafters (the
suffix drafter would otherwise replay pass 1). Printed per SpecRouter variant: tokens/s of the
requests after the first `--after` cold vs warm (goal: >= 0.95) and that ratio over target-only's
own cold / warm on the same requests (this VM's speed moves between passes: target-only read
0.69-1.13x between them, docs/router.md router22), of the first `--after`, probe decisions, greedy
identity with target-only, what measuring D_TV cost, the team governor's drops and restores (a
co-tenant took a core: engine/contention.py) and each system's slowest request.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import time

import torch

from specrouter.api import SpecRouter
from specrouter.bench.workloads import mixed_stream
from specrouter.config import RouterConfig
from specrouter.engine.contention import thread_governor
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.policy import Router
from specrouter.router.setup import load_or_sweep_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-type", type=int, default=6, help="prompts per request type (4 types)")
    ap.add_argument("--after", type=int, default=16, help="cold requests before the comparison")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="bench-out/router_cold.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = base.pool
    profile = load_or_sweep_profile(pool, progress=False)
    requests = mixed_stream(args.per_type, 2)
    ids = [base.encode(r.prompt, chat=r.chat) for r in requests]
    need = max(map(len, ids)) + args.max_new_tokens + 20
    for r in pool.runners.values():
        r.reserve(max(r.num_slots, 1), max(r.max_len, need))
    variants = {"D_TV on": RouterConfig(),
                "D_TV off": RouterConfig(similarity=dataclasses.replace(RouterConfig().similarity, measure_tv=False))}
    current = [0]
    probes = {name: [0] * len(requests) for name in variants}
    routers = {}
    for name, cfg in variants.items():
        def on_decision(ev, name=name):
            if ev.reason == "probe":
                probes[name][current[0]] += 1
        routers[name] = Router.from_pool(pool, copy.deepcopy(profile), config=cfg, on_decision=on_decision)
    cost = {"tv_seconds": 0.0, "step_seconds": 0.0, "steps": 0}  # D_TV's share of the measured steps
    observe = routers["D_TV on"].observe_step

    def counted(report):
        cost["tv_seconds"] += report.tv_seconds
        cost["step_seconds"] += report.wall_time
        cost["steps"] += 1
        observe(report)
    routers["D_TV on"].observe_step = counted
    names = ["target-only", *variants]
    result = {"passes": []}
    warm_up = SpecRouter(pool.with_fresh_drafters(), Router.from_pool(pool, copy.deepcopy(profile)))
    warm_up.generate(ids[0], max_new_tokens=8)  # first forwards allocate
    for p in range(2):
        systems = {"target-only": SpecRouter(pool.with_fresh_drafters())}
        for name, router in routers.items():
            view = pool.with_fresh_drafters()
            systems[name] = SpecRouter(view, router)
        seconds = {n: [0.0] * len(ids) for n in names}
        tokens = {n: [0] * len(ids) for n in names}
        outputs = {n: [None] * len(ids) for n in names}
        for i, x in enumerate(ids):
            current[0] = i
            for j in range(len(names)):
                n = names[(i + p + j) % len(names)]
                kw = {"chain": ("target",)} if n == "target-only" else {}
                t0 = time.perf_counter()
                res = systems[n].generate(x, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                          seed=i, **kw)[0]
                seconds[n][i] = time.perf_counter() - t0
                tokens[n][i], outputs[n][i] = len(res.token_ids), res.token_ids
        result["passes"].append({"seconds": seconds, "tokens": tokens,
                                 "greedy_identical": {n: outputs[n] == outputs["target-only"] for n in variants}
                                 if args.temperature == 0 else None,
                                 "probes": {n: list(v) for n, v in probes.items()}})
        for v in probes.values():
            v[:] = [0] * len(requests)

    def tps(p, n, lo, hi):
        s = result["passes"][p]
        return sum(s["tokens"][n][lo:hi]) / sum(s["seconds"][n][lo:hi])

    a, N = args.after, len(ids)
    load = open("/proc/loadavg").read().split()[:3]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, {args.threads} threads, load average {' '.join(load)}, {N} requests "
          f"(mixed, types every 2), {args.max_new_tokens} new tokens, temperature {args.temperature}")
    summary = {}
    for n in names:
        row = {"cold_first": tps(0, n, 0, a), "cold_after": tps(0, n, a, N),
               "warm_first": tps(1, n, 0, a), "warm_after": tps(1, n, a, N)}
        if n in variants:
            row["cold/warm after"] = row["cold_after"] / row["warm_after"]
            row["probes_cold_first"] = sum(result["passes"][0]["probes"][n][:a])
            row["probes_warm_first"] = sum(result["passes"][1]["probes"][n][:a])
            ident = [result["passes"][p]["greedy_identical"] for p in range(2)]
            row["greedy_identical"] = None if ident[0] is None else all(d[n] for d in ident)
        summary[n] = row
        print(f"{n:12s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    plain = summary["target-only"]["cold_after"] / summary["target-only"]["warm_after"]
    for n in variants:
        s = summary[n]
        # the machine's own speed between the passes: target-only's cold / warm on the same requests
        s["cold/warm after / target-only's"] = s["cold/warm after"] / plain
        print(f"{n}: cold requests {a + 1}..{N} at {s['cold/warm after']:.3f}x warm (goal >= 0.95), "
              f"{s['cold/warm after'] / plain:.3f}x over target-only's own {plain:.3f}x between the passes; "
              f"vs target-only cold {s['cold_after'] / summary['target-only']['cold_after']:.2f}x, "
              f"warm {s['warm_after'] / summary['target-only']['warm_after']:.2f}x")
    print(f"D_TV measurement: {1e3 * cost['tv_seconds'] / max(cost['steps'], 1):.3f} ms per step, "
          f"{cost['tv_seconds'] / max(cost['step_seconds'], 1e-9):.2%} of the steps' time (D_TV on, both passes)")
    gov = thread_governor()  # every system's loop ran on this thread (engine/contention.py)
    governor = {"drops": gov.drops, "restores": gov.restores}
    slowest = {n: max(max(s["seconds"][n]) for s in result["passes"]) for n in names}
    print(f"team governor: {gov.drops} drops to fewer torch threads (another process took a core), "
          f"{gov.restores} restores; slowest request " + ", ".join(f"{n} {v:.2f} s" for n, v in slowest.items()))
    result.update(summary=summary, tv_cost=cost, commit=commit, load=load, threads=args.threads, args=vars(args),
                  governor=governor, slowest=slowest)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
