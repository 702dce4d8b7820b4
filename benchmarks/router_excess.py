"""Where SpecRouter's seconds go against target-only, per engine step (docs/router.md, floor19):
one workload of the bench's prompts, every request decoded by SpecRouter and by target-only in
turn (the order alternating), one process. Each SpecRouter step's excess is its seconds less
target-only's mean decode step times the tokens it committed (a request's first step: less
target-only's first step, its prefill); summed per category: the plan that ran (d: the shipped
draft, T: the target, ng / sx: the n-gram and suffix drafters; k after the colon) and how it was
decided (plan, held, probe; FIRST: the request's first step). Per category: steps, tokens a
step committed and predicted, the model-free drafter's hit rate, excess ms. Then the first
step's forwards (model, new tokens, ms), the prober's own seconds.

    python benchmarks/router_excess.py [--workload chat] [--temperature 0.7] [--prompts-per-type 6]
        [--presence-penalty P] [--frequency-penalty F] [--set FIELD=VALUE ...]

`--set`: RouterConfig fields (a Python literal: decision_margin_sampling=0.0). The wrappers' own seconds (~20-50 us a step)
are in SpecRouter's steps.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import time
from collections import defaultdict

import torch

from specrouter.api import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.bench.systems import AdaptiveSystem, Decoding, NativeSystem
from specrouter.config import RouterConfig
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.setup import load_or_sweep_profile


def timed(obj, name: str, sink: list) -> None:
    """Wrap `obj.name` so each call appends its seconds to `sink`."""
    f = getattr(obj, name)

    def call(*a, **kw):
        t0 = time.perf_counter()
        out = f(*a, **kw)
        sink.append(time.perf_counter() - t0)
        return out
    setattr(obj, name, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompts-per-type", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presence-penalty", type=float, default=None)
    ap.add_argument("--frequency-penalty", type=float, default=None)
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    controls = tuple((f"{n}_penalty", v) for n in ("presence", "frequency")
                     if (v := getattr(args, f"{n}_penalty")) is not None)
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    short = {pool.target: "T", pool.order[-2]: "d", "ngram": "ng", "suffix": "sx"}
    profile = load_or_sweep_profile(pool, progress=False)
    config = dataclasses.replace(RouterConfig(), **{k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    sys_sr = AdaptiveSystem(pool, "SpecRouter", profile=profile, progress=False, router_config=config)
    sys_t = NativeSystem(pool, "target-only", (pool.target,), None)
    for s in (sys_sr, sys_t):  # first forwards allocate
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))
        s.reset()
    router = sys_sr.sr.engine.router
    cur: dict = {}
    plan_batch, observe_step = router.plan_batch, router.observe_step

    def planned(rows, pinned=()):
        batch = plan_batch(rows, pinned)
        d, req = batch.decisions[0], router.requests.get(rows[0].seq_id)
        tokens = 1.0
        if d.k and req is not None and req.table is not None:
            tokens = float(req.table.expected_tokens[router.chain_index[d.chain], d.k - 1])
        cur["plan"] = (d.chain, d.k, "held" if batch.held else d.reason, tokens)
        return batch

    def observed(report):
        if len(report.outcomes) == 1:
            cur["outcome"] = report.outcomes[0]
            cur["forwards"] = [(short.get(f.model, f.model), f.new_tokens, round(1e3 * f.seconds, 2))
                               for f in report.forwards]
        observe_step(report)

    router.plan_batch, router.observe_step = planned, observed
    steps: list = []  # (plan, outcome, forwards, seconds) per SpecRouter engine step
    engine_step = sys_sr.sr.engine.step

    def sr_step(*a, **kw):
        cur.clear()
        t0 = time.perf_counter()
        out = engine_step(*a, **kw)
        steps.append((cur.get("plan"), cur.get("outcome"), cur.get("forwards"), time.perf_counter() - t0))
        return out

    sys_sr.sr.engine.step = sr_step
    t_steps: list = []
    timed(sys_t.sr.engine, "step", t_steps)
    prober = {"decide": [], "_probe": []}
    for name, sink in prober.items():
        timed(router.prober, name, sink)
    cfg = BenchConfig(workloads=(args.workload,), prompts_per_type=args.prompts_per_type,
                      temperatures=(args.temperature,), slowdown=False, hf="none", peers=False, controls=controls)
    scenario = build_scenarios(cfg)[0]
    agg = defaultdict(lambda: [0, 0, 0.0, 0.0, 0])  # steps, tokens, predicted tokens, excess s, hits
    totals = {"SpecRouter": [0, 0.0], "target-only": [0, 0.0]}
    firsts = []

    def label(chain, k):
        return ">".join(short.get(m, m) for m in chain) + (f":{k}" if k else "")

    for i, req in enumerate(scenario.workload.requests):
        ids = sr.encode(req.prompt, chat=req.chat)
        dec = Decoding(args.temperature, cfg.max_new_tokens, cfg.seed + i, controls)
        steps.clear()
        t_steps.clear()
        outs = {}
        for name, s in ([("SpecRouter", sys_sr), ("target-only", sys_t)][:: 1 if i % 2 == 0 else -1]):
            out = outs[name] = s.run(ids, dec)
            totals[name][0] += len(out.token_ids)
            totals[name][1] += out.seconds
        t_step = sum(t_steps[1:]) / max(len(t_steps) - 1, 1)  # target-only's mean decode step
        for j, (plan, o, forwards, seconds) in enumerate(steps):
            if plan is None or o is None:
                key, tokens, predicted, hit = "undecided", 1, 1.0, 0
            else:
                chain, k, why, predicted = plan
                tokens = o.accepted[-1] + 1 if len(o.chain) > 1 else 1
                hit = int(o.drafted[0] > 0) if len(o.chain) > 1 else 0
                key = ("plain" if not k else label(chain, k)) + " " + (why if why in ("probe", "held") else "plan")
            if j == 0:
                key, excess = "FIRST " + key, seconds - t_steps[0] - (tokens - 1) * t_step
                firsts.append((forwards, seconds))
            else:
                excess = seconds - tokens * t_step
            a = agg[key]
            a[0] += 1
            a[1] += tokens
            a[2] += predicted
            a[3] += excess
            a[4] += hit
        speed = {n: len(o.token_ids) / o.seconds for n, o in outs.items()}
        print(f"#{i} {req.kind} SpecRouter {speed['SpecRouter']:.1f} target-only {speed['target-only']:.1f} tok/s, "
              f"SpecRouter - target-only {1e3 * (outs['SpecRouter'].seconds - outs['target-only'].seconds):+.1f} ms; "
              f"target-only's step {1e3 * t_step:.2f} ms, first {1e3 * t_steps[0]:.1f}; SpecRouter's first "
              f"{1e3 * steps[0][3]:.1f}", flush=True)
    speed = {n: t / s for n, (t, s) in totals.items()}
    print(f"total tok/s: SpecRouter {speed['SpecRouter']:.1f} target-only {speed['target-only']:.1f} "
          f"({speed['SpecRouter'] / speed['target-only']:.3f}x)")
    print(f"{'category':24s} {'steps':>5s} {'tok/step':>8s} {'pred':>6s} {'hit':>5s} {'excess ms':>9s}")
    for key, (n, tokens, predicted, excess, hits) in sorted(agg.items(), key=lambda kv: -kv[1][3]):
        print(f"{key:24s} {n:5d} {tokens / n:8.2f} {predicted / n:6.2f} {hits / n:5.2f} {1e3 * excess:9.1f}")
    print(f"excess total {1e3 * sum(a[3] for a in agg.values()):.1f} ms")
    for forwards, seconds in firsts:
        print(f"first step {1e3 * seconds:.1f} ms: forwards {forwards}")
    print("prober: " + ", ".join(f"{n} {len(v)} calls {1e3 * sum(v):.1f} ms" for n, v in prober.items()))


if __name__ == "__main__":
    main()
