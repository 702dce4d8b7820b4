"""Where SpecRouter loses to the oracle, per request (docs/router.md, "Where the router lost"):
the mixed stream (the bench's prompts, 3 per type, 64 new tokens), every request decoded by a
set of static (chain, k) and by one SpecRouter that learns along the stream, in one process.
Per request: the fastest static (the oracle's pick among these), SpecRouter's tokens/s, and
SpecRouter's cycles by decided (chain, k, reason) with their predicted and realized seconds per
token; at the end the router's host-time estimates.

    python benchmarks/router_diagnose.py [--temperature 0] [--variant default|no-step-host]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import torch

from specrouter.api import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.bench.systems import AdaptiveSystem, Decoding, NativeSystem
from specrouter.config import RouterConfig
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.setup import load_or_sweep_profile

STATIC = [  # (chain, k): the static chains that won some request type in earlier runs
    (("draft",), 0), (("draft", "target"), 2), (("draft", "target"), 4), (("draft", "target"), 8),
    (("ngram", "target"), 8), (("suffix", "target"), 8), (("ngram", "draft", "target"), 4),
    (("ngram", "draft", "target"), 8), (("suffix", "draft", "target"), 4),
]


def label(chain, k) -> str:
    return ">".join(chain) + (f" k={k}" if k else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--variant", default="default", choices=["default", "no-step-host"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    names = {"draft": pool.order[-2], "target": pool.target}  # the shipped draft, the target
    print(f"pool order: {pool.order}", flush=True)
    profile = load_or_sweep_profile(pool, progress=False)
    config = RouterConfig() if args.variant == "default" else dataclasses.replace(RouterConfig(), draft_step_overhead=False)
    adaptive = AdaptiveSystem(pool, "SpecRouter", profile=profile, progress=False, router_config=config)
    statics = {}
    for chain, k in STATIC:
        chain = (pool.target,) if chain == ("draft",) else tuple(names.get(m, m) for m in chain)
        statics[label(chain, k)] = NativeSystem(pool, label(chain, k), chain, k or None)
    events: list = []
    adaptive.reset(on_decision=events.append)
    for s in [*statics.values(), adaptive]:  # first forwards allocate
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))
    router = adaptive.sr.engine.router
    cycles: list = []  # every StepReport the router observes (one row: one per decision)
    observe = router.observe_step

    def observe_step(report):
        cycles.append(report)
        observe(report)

    router.observe_step = observe_step
    events.clear()
    cfg = BenchConfig(workloads=("mixed",), prompts_per_type=3, temperatures=(args.temperature,),
                      slowdown=False, hf="none", peers=False)
    scenario = build_scenarios(cfg)[0]
    totals = defaultdict(lambda: [0, 0.0])
    oracle = [0, 0.0]  # tokens, seconds of the fastest static per request
    for i, req in enumerate(scenario.workload.requests):
        ids = sr.encode(req.prompt, chat=req.chat)
        dec = Decoding(args.temperature, cfg.max_new_tokens, cfg.seed + i)
        speeds = {}
        for name, s in statics.items():
            out = s.run(ids, dec)
            speeds[name] = len(out.token_ids) / out.seconds
            totals[name][0] += len(out.token_ids)
            totals[name][1] += out.seconds
        events.clear()
        cycles.clear()
        out = adaptive.run(ids, dec)
        totals["SpecRouter"][0] += len(out.token_ids)
        totals["SpecRouter"][1] += out.seconds
        sr_speed = len(out.token_ids) / out.seconds
        best = max(speeds, key=speeds.get)
        print(f"#{i} {req.kind:10s} SR {sr_speed:.0f} tok/s, best static {best} {speeds[best]:.0f} "
              f"({sr_speed / speeds[best]:.2f}x), target-only {speeds[label((pool.target,), 0)]:.0f}", flush=True)
        oracle[0] += len(out.token_ids)
        oracle[1] += len(out.token_ids) / speeds[best]
        if events:  # the acceptance estimates of the request's last decision, and the global ones
            mode = events[-1].mode
            print("    alphas (request / global): " + ", ".join(
                f"{'>'.join(p)} {a:.2f}/{router.alpha(p, mode):.2f}" for p, a in events[-1].alphas.items()
                if p[1] == pool.target or p[0] == names["draft"]), flush=True)
        by_plan = defaultdict(lambda: [0, 0.0, 0.0, 0])  # cycles, predicted s, realized s, tokens
        if len(events) != len(cycles):
            print(f"    ({len(events)} decisions, {len(cycles)} steps: not matched)")
            continue
        for e, c in zip(events[1:], cycles[1:]):  # the first step prefills
            o = c.outcomes[0]
            committed = o.accepted[-1] + 1 if len(o.chain) > 1 else 1
            key = (label(e.chain, e.k), e.reason if e.reason in ("probe", "initial") else "plan")
            by_plan[key][0] += 1
            by_plan[key][1] += e.t_eff * committed
            by_plan[key][2] += c.wall_time
            by_plan[key][3] += committed
        for (plan, why), (n, pred, real, toks) in sorted(by_plan.items(), key=lambda kv: -kv[1][0]):
            print(f"    {plan:28s} {why:8s} cycles {n:3d} tok/cycle {toks / n:4.2f} "
                  f"predicted {1e3 * pred / toks:5.2f} ms/tok realized {1e3 * real / toks:5.2f}", flush=True)
    print(f"oracle (fastest static per request) {oracle[0] / oracle[1]:.1f} tok/s")
    print("overheads (ms): " + " ".join(f"{k} {1e3 * v:.3f}" for k, v in router.overhead.items())
          + f" decide {1e3 * router.decide_seconds:.3f}")
    print("total tok/s: " + " ".join(f"{n} {t / s:.1f}" for n, (t, s) in totals.items()))


if __name__ == "__main__":
    main()
