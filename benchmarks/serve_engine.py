"""The router under load without the server (issue 26's serving goal, separated from HTTP):
the serving bench's mixed request stream through the engine's own continuous batching at
concurrency c, the router against plain batching of the target, side by side in one process,
each round on its own view of the pool (`Pool.with_fresh_drafters()`), alternating which goes
first. One router learns along the whole run (as a server's does).

Per level: tokens/s of both and the ratio; with `--trace`, the router's steps by kind (held
plain, planned plain, speculative): their count, mean rows, predicted and realised seconds per
step (the planner's `step_seconds` at the plans that ran, against the executor's wall time
plus the planning), tokens per step, target forwards per step, host seconds per step (wall
minus forwards) and forward seconds per step; the plain engine's steps beside them.

    python benchmarks/serve_engine.py [--concurrency 2 4 8] [--temperature 0] [--requests 16]
        [--max-new-tokens 64] [--rounds 2] [--trace] [--set FIELD=VALUE ...]
        [--arm NAME FIELD=VALUE ... [--arm ...]] [--planner-from NAME PATH]

Each round's line says how many CPU seconds other processes took while it ran (Linux): a
co-tenant outside the CPU lock stalls a round 2-5x, and such a round is void.

Per level the ratio three ways: of the summed tokens and seconds, of the rounds' medians, and
the median of each round's own ratio (the router's round against the plain round run next to it:
this machine's speed drifts +-10% between minutes, so a round's pair is the closest comparison).

`--arm` adds a router of its own config (the `--set` fields, then its own) beside the first,
in the same process and rounds (each on its own pool view, the order rotating each round), so
two configs are compared side by side, each against the same plain rounds (every system takes
every position equally often only when --rounds is a multiple of the systems' count: a warning
says so otherwise). At temperature 0
every router's outputs are checked token for token against plain decoding's (a line says
whether they are identical).

`--planner-from NAME PATH` makes arm NAME (one of the `--arm` names) plan its batches with the
`BatchPlanner` of another checkout's router/batch.py (PATH, e.g. main's), so a change to the
batch planner runs side by side with the planner before it in one process.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from specrouter.api import SpecRouter
from specrouter.bench.serve import continuous_batching, prompts
from specrouter.config import PoolConfig, RouterConfig, SamplingParams
from specrouter.engine import engine as engine_module
from specrouter.engine import isolation as isolation_module
from specrouter.engine.engine import Engine
from specrouter.models.default_pool import default_pool_paths
from specrouter.models.pool import Pool, preview_pool
from specrouter.router.setup import build_router


class StepLog:
    """Every step of one engine: (kind, rows, predicted s, realised s, tokens, target forwards, host s,
    forward s)."""

    def __init__(self, engine: Engine, planner=None):
        self.steps: list[tuple] = []
        self.engine, self.planner = engine, planner
        report = engine._report

        def logged(rows, ran):
            result = ran[0]
            if result is not None:
                t0 = time.perf_counter()
                self.record(rows, result)
                self.own_seconds += time.perf_counter() - t0  # the log's, not the engine's
            report(rows, ran)

        engine._report = logged
        step, execute = engine.step, engine.executor.step
        self.engine_seconds = self.executor_seconds = 0.0
        # seconds spent recording steps (the router's predicted seconds of each: a step_seconds
        # call): taken out of the engine's step and of the round's wall time (`main`)
        self.own_seconds = 0.0

        self.kind = None  # the kind of the step being run (set by record)
        self.step_parts: dict[str, float] = defaultdict(float)  # this step's parts
        # kind -> [steps, seconds outside the executor, {part: seconds}]
        self.by_kind: dict[str, list] = defaultdict(lambda: [0, 0.0, defaultdict(float)])

        def timed_step():
            t0 = time.perf_counter()
            executor_before, own_before = self.executor_seconds, self.own_seconds
            self.kind, self.step_parts = None, defaultdict(float)
            out = step()
            wall = time.perf_counter() - t0 - (self.own_seconds - own_before)
            self.engine_seconds += wall
            if self.kind is not None:
                k = self.by_kind[self.kind]
                k[0] += 1
                k[1] += wall - (self.executor_seconds - executor_before)
                for part, v in self.step_parts.items():
                    k[2][part] += v
            return out

        def timed_execute(*a, **kw):
            t0 = time.perf_counter()
            out = execute(*a, **kw)
            self.executor_seconds += time.perf_counter() - t0
            return out

        engine.step, engine.executor.step = timed_step, timed_execute
        self.parts: dict[str, float] = defaultdict(float)  # router-side work outside the executor
        if engine.router is not None:
            for obj, attr in ((engine.router, "plan_batch"), (engine.router, "observe_step"),
                              (engine.router, "take_confident_drafts"), (engine_module, "shadow_proposals"),
                              (engine_module, "confident_offers"), (engine_module, "judge_shadows")):
                setattr(obj, attr, self.timer(attr, getattr(obj, attr)))
        isolation_module.snapshot = self.timer("snapshot", isolation_module.snapshot)

    def timer(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.parts[name] += dt
                self.step_parts[name] += dt
        timed.original = fn
        return timed

    def close(self) -> None:
        """Undo the wrappers (one router serves every round)."""
        for attr in ("shadow_proposals", "confident_offers", "judge_shadows"):
            f = getattr(engine_module, attr)
            setattr(engine_module, attr, getattr(f, "original", f))
        f = isolation_module.snapshot
        isolation_module.snapshot = getattr(f, "original", f)
        if self.engine.router is not None:
            for attr in ("plan_batch", "observe_step", "take_confident_drafts"):
                f = getattr(self.engine.router, attr)
                setattr(self.engine.router, attr, getattr(f, "original", f))

    def record(self, rows, result) -> None:
        plans = [(tuple(o.chain), o.k) for o in result.outcomes]
        tokens = sum(int(o.accepted[len(o.chain) - 1]) + 1 if len(o.chain) > 1 and o.k > 0 else 1
                     for o in result.outcomes)
        target = self.engine.pool.target
        fwd = sum(1 for f in result.forwards if f.model == target)
        host = result.wall_time - sum(result.forward_time.values())
        predicted = realised = float("nan")
        if self.planner is not None:
            L = max(1, sum(o.context_len for o in result.outcomes) // len(plans))
            predicted = self.planner.step_seconds(plans, L, publish=False)
            # this step's planning (a leased step has none: the planner's plan_seconds still holds
            # the lease's planning until the lease's steps are observed)
            realised = result.wall_time + self.step_parts["plan_batch"] + self.step_parts["take_confident_drafts"]
        kind = self.engine.last_step_kind  # "held" on a hold or its lease (engine.step_kind)
        self.kind = kind
        self.steps.append((kind, len(plans), predicted, realised if self.planner else result.wall_time,
                           tokens, fwd, host, sum(result.forward_time.values())))


def summary(log: StepLog, label: str) -> list[str]:
    by = defaultdict(list)
    for s in log.steps:
        by[(s[0], s[1])].append(s)
    out = []
    for (kind, n), ss in sorted(by.items()):
        mean = lambda i: statistics.fmean(x[i] for x in ss)  # noqa: E731
        out.append(f"  {label:6s} {kind:5s} rows={n} steps={len(ss):4d} pred={mean(2) * 1e3:6.1f} ms "
                   f"real={mean(3) * 1e3:6.1f} ms tok/step={mean(4):.2f} tfwd/step={mean(5):.2f} "
                   f"host={mean(6) * 1e3:5.2f} ms fwd={mean(7) * 1e3:6.2f} ms  tok/s={sum(x[4] for x in ss) / sum(x[3] for x in ss):.1f}")
    return out


def load_stream(requests: int, concurrency: list[int], max_new_tokens: int):
    """The default pool, the serving bench's request stream (max(requests, concurrency)
    prompts, token ids) and the context length its rows need."""
    pcfg = PoolConfig(models=tuple(str(p) for p in default_pool_paths()))
    pool = Pool.from_config(pcfg, paths=list(preview_pool(pcfg).paths))
    sr = SpecRouter(pool)
    ids = [sr.encode(p, chat=chat) for p, chat in prompts(max(requests, *concurrency))]
    return pool, ids, max(len(x) for x in ids) + max_new_tokens + 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="RouterConfig overrides, e.g. plain_hold_max=0 batch_plain_margin=0.05")
    ap.add_argument("--arm", nargs="+", action="append", default=[], metavar="NAME [FIELD=VALUE ...]",
                    help="another router beside the first: its name, then its RouterConfig overrides")
    ap.add_argument("--planner-from", nargs=2, action="append", default=[], metavar=("NAME", "PATH"),
                    help="arm NAME plans with the BatchPlanner of the router/batch.py at PATH (e.g. main's)")
    args = ap.parse_args()

    pool, ids, max_len = load_stream(args.requests, args.concurrency, args.max_new_tokens)
    n_req = len(ids)

    def literal(pairs):  # a Python literal, as router_overhead.py / router_replay.py take it (the
        # field's type called on the text read "False" as True)
        return {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in pairs)}

    over = literal(args.set)
    configs = {"router": over, **{a[0]: {**over, **literal(a[1:])} for a in args.arm}}
    if "plain" in configs or len(configs) != 1 + len(args.arm):
        raise SystemExit("--arm names must be distinct, not 'router' or 'plain'")
    routers = {name: build_router(pool, progress=False, config=RouterConfig(**cfg)) for name, cfg in configs.items()}
    for name, path in args.planner_from:
        if name not in routers or name == "router":
            raise SystemExit(f"--planner-from {name}: not an --arm name")
        routers[name].planner = planner_from(path)(routers[name])
    print(f"cpu: {os.cpu_count()} cores, load {os.getloadavg()}, t={args.temperature}, "
          f"{n_req} requests x {args.max_new_tokens} tokens, router config {over}"
          + "".join(f"; {a[0]} {configs[a[0]]}" for a in args.arm))
    systems = [*routers, "plain"]
    if args.rounds % len(systems):
        print(f"warning: --rounds {args.rounds} is not a multiple of the {len(systems)} systems: "
              "the order's rotation favours some positions (the first runs on the warmest caches)")
    for c in args.concurrency:
        tps = {name: [0, 0.0] for name in systems}
        logs = {name: [] for name in systems}
        outputs = {name: {} for name in systems}
        per_round = {name: [] for name in systems}  # tok/s of each round (a co-tenant's stall hits one)
        for r in range(args.rounds):
            turn = r % len(systems)
            for name in systems[turn:] + systems[:turn]:
                view = pool.with_fresh_drafters()
                engine = Engine(view, max_num_seqs=c, max_model_len=max_len, router=routers.get(name))
                chain = None if name in routers else (view.target,)
                warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
                continuous_batching(engine, [x[:8] for x in ids[:c]], warm, c, chain)
                log = StepLog(engine, routers[name].planner if name in routers else None)
                params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                         ignore_eos=True, seed=i) for i in range(n_req)]
                busy0, cpu0 = machine_busy(), time.process_time()
                t0 = time.perf_counter()
                seqs = run(engine, ids, params, c, chain)
                wall = time.perf_counter() - t0 - log.own_seconds
                others = None if busy0 is None else max(0.0, machine_busy() - busy0 - (time.process_time() - cpu0))
                log.close()
                tps[name][0] += sum(len(s.output_ids) for s in seqs)
                tps[name][1] += wall
                per_round[name].append(sum(len(s.output_ids) for s in seqs) / wall)
                logs[name].append(log)
                for i, s in enumerate(seqs):
                    outputs[name].setdefault(i, []).append(list(s.output_ids))
                print(f"c={c} round {r + 1} {name}: {len(log.steps)} steps, "
                      f"{sum(len(s.output_ids) for s in seqs) / wall:.1f} tok/s"
                      + ("" if others is None else f", other processes' CPU {others:.2f} s"), flush=True)
        rate = {k: v[0] / v[1] for k, v in tps.items()}
        for name in routers:
            print(f"c={c} t={args.temperature}: {name} {rate[name]:.1f} tok/s, plain {rate['plain']:.1f} tok/s, "
                  f"ratio {rate[name] / rate['plain']:.3f}; of the rounds' medians "
                  f"{statistics.median(per_round[name]) / statistics.median(per_round['plain']):.3f}; "
                  f"median of the rounds' own ratios "
                  f"{statistics.median(a / b for a, b in zip(per_round[name], per_round['plain'])):.3f}"
                  f"  (load {os.getloadavg()[0]:.2f})", flush=True)
        if args.temperature == 0.0:
            plain_out = {i: outs[0] for i, outs in outputs["plain"].items()}
            differ = {name: sum(o != plain_out[i] for i, outs in outputs[name].items() for o in outs)
                      for name in systems}
            print(f"c={c} greedy outputs identical to plain's: " + ", ".join(
                f"{name} {'yes' if not n else f'NO ({n} differ)'}" for name, n in differ.items()), flush=True)
        if args.trace:
            for name, ls in logs.items():
                merged = StepLog.__new__(StepLog)
                merged.steps = [s for lg in ls for s in lg.steps]
                outside = sum(lg.engine_seconds - lg.executor_seconds for lg in ls) / len(merged.steps)
                parts = defaultdict(float)
                for lg in ls:
                    for k, v in lg.parts.items():
                        parts[k] += v / len(merged.steps)
                print(f"  {name:6s} engine step outside the executor: {outside * 1e3:.2f} ms/step" +
                      "".join(f"; {k} {v * 1e3:.2f}" for k, v in parts.items()))
                print("\n".join(summary(merged, name)))
                kinds = defaultdict(lambda: [0, 0.0, defaultdict(float)])
                for lg in ls:
                    for kind, (n, sec, parts) in lg.by_kind.items():
                        kinds[kind][0] += n
                        kinds[kind][1] += sec
                        for part, v in parts.items():
                            kinds[kind][2][part] += v
                for kind, (n, sec, parts) in sorted(kinds.items()):
                    print(f"  {name:6s} {kind:5s} steps={n:4d} outside the executor {sec / n * 1e3:.3f} ms/step" +
                          "".join(f"; {k} {v / n * 1e3:.3f}" for k, v in sorted(parts.items())))
            for name, router in routers.items():
                events = list(router.planner.events)[-2000:]
                reasons = defaultdict(int)
                for e in events:
                    reasons[(e[1], e[2])] += 1
                print(f"  {name} planner events (rows, reason): " + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())))
                cal = {k: (round(float(v.factor(router.config.batch_calibration_prior)), 3), round(v.weight, 1))
                       for k, v in router.planner.calibrations.items()}
                print(f"  {name} calibrations (rows, spec, sampled): {cal}")
                cs = router.cache_stats
                print(f"  {name} decision cache: {cs.hits} hits, {cs.misses} misses, by reason {dict(cs.reasons)}; "
                      f"publications {dict(router.board.publications)}")


def machine_busy() -> float | None:
    """The machine's busy CPU seconds so far (all but idle and iowait, /proc/stat; None where
    there is none): a round's busy seconds less the process's own are other processes' (a
    co-tenant outside the CPU lock stalls a round 2-5x here, and a stalled round is void)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def planner_from(path: str):
    """The `BatchPlanner` class of the router/batch.py at `path`, loaded as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"planner_from_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--planner-from: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses read their module
    spec.loader.exec_module(module)
    return module.BatchPlanner


def run(engine, ids, params, concurrency, chain):
    """`continuous_batching` with one SamplingParams per request."""
    waiting, running, done = list(range(len(ids))), {}, {}
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.pop(0)
            running[i] = engine.add_request(ids[i], params[i], chain=chain, k=1)
        engine.step()
        for i, seq in list(running.items()):
            if seq.done:
                done[i] = running.pop(i)
    return [done[i] for i in range(len(ids))]


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
