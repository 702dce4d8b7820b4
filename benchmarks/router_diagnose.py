"""Where SpecRouter loses to the oracle, per request (docs/router.md, "Where the router lost"):
the mixed stream (the bench's prompts, 3 per type, 64 new tokens), every request decoded by a
set of static (chain, k) and by one SpecRouter that learns along the stream, in one process.
Per request: the fastest static (the oracle's pick among these), SpecRouter's tokens/s, and
SpecRouter's cycles by decided (chain, k, reason) with their predicted and realized seconds per
token; at the end the router's host-time estimates.

    python benchmarks/router_diagnose.py [--temperature 0]
        [--workload mixed|chat|...] [--prompts-per-type 3] [--presence-penalty P] [--frequency-penalty F]
        [--repetition-penalty R] [--timeline]
"""

from __future__ import annotations

import argparse
import time
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
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="mixed", help="mixed or one request type (chat, prose, code, extraction)")
    ap.add_argument("--prompts-per-type", type=int, default=3)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--timeline", action="store_true", help="per request, the plans run in order (x cycles, tokens)")
    args = ap.parse_args()
    controls = tuple((name, value) for name, value, off in (
        ("presence_penalty", args.presence_penalty, 0.0), ("frequency_penalty", args.frequency_penalty, 0.0),
        ("repetition_penalty", args.repetition_penalty, 1.0)) if value != off)
    torch.set_num_threads(args.threads)
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    names = {"draft": pool.order[-2], "target": pool.target}  # the shipped draft, the target
    print(f"pool order: {pool.order}", flush=True)
    profile = load_or_sweep_profile(pool, progress=False)
    adaptive = AdaptiveSystem(pool, "SpecRouter", profile=profile, progress=False, router_config=RouterConfig())
    statics = {}
    for chain, k in STATIC:
        chain = (pool.target,) if chain == ("draft",) else tuple(names.get(m, m) for m in chain)
        statics[label(chain, k)] = NativeSystem(pool, label(chain, k), chain, k or None)
    events: list = []
    adaptive.reset(on_decision=events.append)
    for s in [*statics.values(), adaptive]:  # first forwards allocate
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))
    adaptive.reset(on_decision=events.append)  # a cold router, as the bench's (run.py warm_up)
    router = adaptive.sr.engine.router
    cycles: list = []  # (decision, predicted tokens, predicted seconds, StepReport, step seconds) per one-row step
    pending: list = []
    plan_batch, observe = router.plan_batch, router.observe_step

    def planned(rows, pinned=()):
        t0 = time.perf_counter()
        batch = plan_batch(rows, pinned)
        d, req = batch.decisions[0], router.requests.get(rows[0].seq_id)
        tokens, seconds = 1.0, float("nan")
        if req is not None and req.table is not None:
            i, j = router.chain_index[d.chain], max(d.k, 1) - 1
            tokens = float(req.table.expected_tokens[i, j]) if d.k else 1.0
            seconds = float(req.table.expected_latency[i, j])
        pending[:] = [(d, tokens, seconds, t0)]
        return batch

    def observe_step(report):
        if pending and len(report.outcomes) == 1:  # + the seconds from planning to observing
            cycles.append((*pending[0][:3], report, time.perf_counter() - pending[0][3]))
        pending.clear()
        observe(report)

    router.plan_batch, router.observe_step = planned, observe_step
    plain_steps: list = []  # target-only's engine steps of the request (seconds)
    plain_engine = statics[label((pool.target,), 0)].sr.engine
    plain_step = plain_engine.step

    def timed_step():
        t0 = time.perf_counter()
        out = plain_step()
        plain_steps.append(time.perf_counter() - t0)
        return out

    plain_engine.step = timed_step
    events.clear()
    cfg = BenchConfig(workloads=(args.workload,), prompts_per_type=args.prompts_per_type,
                      temperatures=(args.temperature,), slowdown=False, hf="none", peers=False, controls=controls)
    scenario = build_scenarios(cfg)[0]
    totals = defaultdict(lambda: [0, 0.0])
    oracle = [0, 0.0]  # tokens, seconds of the fastest static per request
    for i, req in enumerate(scenario.workload.requests):
        ids = sr.encode(req.prompt, chat=req.chat)
        dec = Decoding(args.temperature, cfg.max_new_tokens, cfg.seed + i, controls)
        speeds = {}
        plain_steps.clear()
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
        if cycles:
            steps = sum(c[4] for c in cycles)
            print(f"    request {1e3 * out.seconds:.1f} ms: first step {1e3 * cycles[0][4]:.1f} ms, the others "
                  f"{1e3 * (steps - cycles[0][4]):.1f} ms, outside steps {1e3 * (out.seconds - steps):.1f} ms; "
                  f"target-only: first step {1e3 * plain_steps[0]:.1f} ms, the others {1e3 * sum(plain_steps[1:]):.1f} ms",
                  flush=True)
        oracle[0] += len(out.token_ids)
        oracle[1] += len(out.token_ids) / speeds[best]
        if events:  # the acceptance estimates of the request's last decision, and the global ones
            mode = events[-1].mode
            print("    alphas (request / global): " + ", ".join(
                f"{'>'.join(p)} {a:.2f}/{router.alpha(p, mode):.2f}" for p, a in events[-1].alphas.items()),
                flush=True)
        # per decided plan: cycles, predicted tokens, predicted s, realized s, tokens committed
        by_plan = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0.0])
        for d, p_tokens, p_seconds, c, step in cycles[1:]:  # the first step prefills
            o = c.outcomes[0]
            committed = o.accepted[-1] + 1 if len(o.chain) > 1 else 1
            why = d.reason if d.reason in ("probe", "initial", "batch-plain") else "plan"
            key = (label(d.chain, d.k), "held" if why == "batch-plain" else why)
            b = by_plan[key]
            b[0] += 1
            b[1] += p_tokens
            b[2] += p_seconds
            b[3] += c.wall_time
            b[4] += committed
            b[5] += step
        if args.timeline:  # the plans run, in order: plan x cycles (tokens committed)
            runs: list = []
            for d, _, _, c, _ in cycles[1:]:
                o = c.outcomes[0]
                plan = label(tuple(o.chain), d.k if len(o.chain) > 1 else 0) + ("?" if d.reason == "probe" else "")
                tokens = o.accepted[-1] + 1 if len(o.chain) > 1 else 1
                if runs and runs[-1][0] == plan:
                    runs[-1][1] += 1
                    runs[-1][2] += tokens
                else:
                    runs.append([plan, 1, tokens])
            print("    timeline: " + " | ".join(f"{p} x{n} ({t})" for p, n, t in runs), flush=True)
        for (plan, why), (n, p_tok, p_s, real, toks, steps) in sorted(by_plan.items(), key=lambda kv: -kv[1][0]):
            print(f"    {plan:28s} {why:8s} cycles {n:3d} tok/cycle {toks / n:4.2f} (predicted {p_tok / n:4.2f}) "
                  f"ms/cycle {1e3 * real / n:5.2f}, with planning {1e3 * steps / n:5.2f} (predicted {1e3 * p_s / n:5.2f}) "
                  f"ms/tok {1e3 * real / toks:5.2f} (predicted {1e3 * p_s / p_tok:5.2f})", flush=True)
        cycles.clear()
    print(f"oracle (fastest static per request) {oracle[0] / oracle[1]:.1f} tok/s")
    print("overheads (ms): " + " ".join(f"{k} {1e3 * v:.3f}" for k, v in router.overhead.items())
          + f" decide {1e3 * router.decide_seconds:.3f}")
    for mode in ("greedy", "sampling"):
        print(f"global alphas ({mode}): " + ", ".join(
            f"{'>'.join(p)} {a:.2f} ({src}, {router.similarity.stats(p, mode).trials:.0f} trials)"
            for p in [*router.pairs, *router.triples] for a, src in [router.similarity.alpha_detail(p, mode)]))
    print("total tok/s: " + " ".join(f"{n} {t / s:.1f}" for n, (t, s) in totals.items()))


if __name__ == "__main__":
    main()
