"""Where an engine step's host time goes around the executor (docs/router.md, "The router's own
time"): SpecRouter and target-only, request by request in turn on the same prompts (the bench's
mixed stream, or one workload), each engine part timed per step. Per system: ms per step of the
whole step, its host time (the step less the executor), the executor, and each part outside it
(the router's plan_batch and observe_step, the tree policy, shadow proposals and their judging,
confident-draft checks, the engine's own planning, reporting and collecting); SpecRouter's steps
by kind (held plain, decided plain, speculative), against target-only's steps (what a settled-plain
cycle costs over target-only).

    python benchmarks/router_overhead.py [--workload mixed|chat|...] [--temperature 0] [--prompts-per-type 3]
        [--presence-penalty P] [--frequency-penalty F] [--repetition-penalty R] [--set FIELD=VALUE ...]

`--set`: RouterConfig fields of SpecRouter's router (a Python literal: stream_hold_steps=4).
`--statics draft>target:1 ...`: static chains beside them ("draft" and "target" name the pool's
last two models, as in router_variants.py): the steps of a chain SpecRouter mostly runs, at its cost
without a router (a SpecRouter step of the same plan against it is the router's whole toll).
`--base-router CHECKOUT`: a third system, "SR-base", whose router is another checkout's router
package (its src/specrouter/router, loaded beside this one as `specrouter_base.router`; the rest of
specrouter, RouterConfig included, is this checkout's, so its router must read this RouterConfig's
fields): an old router against the new one in one process, on the same prompts in turns; prints
their ratios and whether their outputs were the same.
With `--statics`, each system's decode steps of a static's plan are also shown inside the
executor: each forward's ms by model and width, and the executor's own ms outside them (the
same plan, the same work: what differs there is not the router's planning).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specrouter.api import SpecRouter
from specrouter.bench.run import BenchConfig, build_scenarios
from specrouter.bench.systems import AdaptiveSystem, Decoding, NativeSystem
from specrouter.config import RouterConfig
from specrouter.engine import engine as engine_module
from specrouter.engine.contention import thread_governor
from specrouter.errors import ChainError
from specrouter.models.default_pool import default_pool_paths
from specrouter.router.setup import load_or_sweep_profile

PARTS = ("plan_batch", "observe_step", "tree_shapes", "tree_observe", "shadow_proposals", "judge_shadows",
         "confident_offers", "executor")
# the engine's own parts around them (Engine._plan_step, ._report, ._collect: each less the parts
# above it calls), shown after the parts: "engine_plan" the row contexts and plan bookkeeping,
# "engine_report" the StepReport, "collect" the outputs and a finished request's end (drafters
# indexing it, the prefix cache, the router's finish_request)
ENGINE = ("_plan_step", "_report", "_collect")
MAX_DECODE_WIDTH = 8  # forwards at most this wide: a decode step's (not a prefill's or a long catch-up's)
INSIDE = ("decide", "plans", "board")  # inside plan_batch: decide(), its PlanTables (cache misses), board.current()


class Timers:
    """Seconds per named part, summed; `kind` labels the engine step being timed."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.system = ""
        self.current: dict[str, float] = defaultdict(float)
        self.plan = None  # the plan of the last executor step's one row (None: several rows)
        # "system label" -> seconds inside the executor's decode steps of a static's plan (`instrument`)
        self.inside: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
        return timed


def instrument(system, timers: Timers, marked: dict | None = None) -> None:
    """Time `system`'s engine parts per step; `marked`: plan -> label, a one-row step running
    such a plan is counted apart (kind + " " + label: SpecRouter's steps of a static's plan)."""
    engine = system.sr.engine
    marked = marked or {}
    if engine.router is not None:
        engine.router.plan_batch = timers.wrap("plan_batch", engine.router.plan_batch)
        engine.router.observe_step = timers.wrap("observe_step", engine.router.observe_step)
        engine.router.decide = timers.wrap("decide", engine.router.decide)
        engine.router._plans = timers.wrap("plans", engine.router._plans)
        engine.router.board.current = timers.wrap("board", engine.router.board.current)
    for name in ENGINE:
        setattr(engine, name, timers.wrap(name, getattr(engine, name)))
    if engine.tree_policy is not None:
        engine.tree_policy.shapes = timers.wrap("tree_shapes", engine.tree_policy.shapes)
        engine.tree_policy.observe = timers.wrap("tree_observe", engine.tree_policy.observe)
    executor_step = engine.executor.step

    def step(rows, plans, *args, **kwargs):
        timers.current["ran"] += 1
        timers.plan = tuple(plans[0]) if len(plans) == 1 else None
        result = timers.wrap("executor", executor_step)(rows, plans, *args, **kwargs)
        if timers.plan in marked and all(f.new_tokens <= MAX_DECODE_WIDTH for f in result.forwards):
            # a decode step of a static's plan (no prefill or catch-up wider than that): its
            # forwards one by one (model, width) and the executor's own time outside them
            key = f"{system.name} {marked[timers.plan]}"
            inside = timers.inside[key]
            inside["steps"] += 1
            inside["outside forwards"] += timers.current["executor"] - sum(f.seconds for f in result.forwards)
            seen = defaultdict(int)
            for f in result.forwards:
                seen[f.model] += 1
                inside[f"{f.model} #{seen[f.model]} w{f.new_tokens:g}"] += f.seconds
                inside[f"{f.model} #{seen[f.model]} w{f.new_tokens:g} n"] += 1
        return result

    engine.executor.step = step
    engine_step = engine.step

    def whole():
        timers.current.clear()
        first = any(len(s.tokens) == s.prompt_len for s in engine.running.values())  # a prefill
        t0 = time.perf_counter()
        out = engine_step()
        wall = time.perf_counter() - t0
        # the engine's step kind (engine.STEP_KINDS): "held" a plain step planned by a hold (no
        # decide), "plain" a decided one (or target-only's), "spec"; "first" a request's first step
        kind = "first" if first else engine.last_step_kind if timers.current.get("ran") else "none"
        if kind in ("spec", "plain", "held"):  # decided (decide() ran) or held
            kind += "-dec" if timers.current.get("decide") else "-nod"
            if timers.plan in marked and engine.router is not None:
                kind += " " + marked[timers.plan]
        key = f"{system.name} {kind}"
        timers.steps[key] += 1
        timers.seconds[(key, "step")] += wall
        for part in PARTS + INSIDE + ENGINE:
            timers.seconds[(key, part)] += timers.current.get(part, 0.0)
        return out

    engine.step = whole


def base_router(checkout: str):
    """(Router class, profile module) of another checkout's router package, loaded as
    `specrouter_base.router` (module docstring)."""
    src = Path(checkout).expanduser() / "src" / "specrouter" / "router"
    if not (src / "policy.py").is_file():
        raise SystemExit(f"--base-router: {checkout} has no src/specrouter/router/policy.py")
    root = Path(tempfile.mkdtemp(prefix="base_router_"))
    pkg = root / "specrouter_base" / "router"
    pkg.mkdir(parents=True)
    (root / "specrouter_base" / "__init__.py").write_text("")
    for f in src.glob("*.py"):
        (pkg / f.name).write_text(f.read_text().replace("specrouter.router", "specrouter_base.router"))
    sys.path.insert(0, str(root))
    return (importlib.import_module("specrouter_base.router.policy").Router,
            importlib.import_module("specrouter_base.router.profile"))


class BaseRouterSystem(AdaptiveSystem):
    """SpecRouter whose router is `router_class` (`base_router`), on its own copy of the profile
    as its profile module's classes (their own observe and predict)."""

    def __init__(self, pool, name, router_class, profile_module, **kwargs):
        super().__init__(pool, name, **kwargs)
        self.router_class, self.profile_module = router_class, profile_module

    def reset(self, on_decision=None) -> None:
        from specrouter.bench import systems

        profile = copy.deepcopy(self.profile)
        profile.__class__ = self.profile_module.CostProfile
        for table in profile._models.values():
            table.__class__ = self.profile_module._ModelTable
        pool = self.pool.with_fresh_drafters()
        router = self.router_class.from_pool(pool, profile, on_decision=on_decision, config=self.router_config)
        systems._forget(self.sr)
        self.sr = SpecRouter(pool, router, systems._config(self.prefix_cache, self.trees))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts-per-type", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--base-router", metavar="CHECKOUT", help="a third system: another checkout's router")
    ap.add_argument("--statics", nargs="*", default=[], help="static chains beside them: draft>target:1 ...")
    args = ap.parse_args()
    base = base_router(args.base_router) if args.base_router else None
    config = dataclasses.replace(RouterConfig(), **{k: ast.literal_eval(v) for k, _, v in
                                                   (a.partition("=") for a in args.set)})
    controls = tuple((name, value) for name, value, off in (
        ("presence_penalty", args.presence_penalty, 0.0), ("frequency_penalty", args.frequency_penalty, 0.0),
        ("repetition_penalty", args.repetition_penalty, 1.0)) if value != off)
    torch.set_num_threads(args.threads)
    for name in ("shadow_proposals", "judge_shadows", "confident_offers"):
        setattr(engine_module, name, TIMERS.wrap(name, getattr(engine_module, name)))
    sr = SpecRouter.from_pretrained(default_pool_paths(progress=False), adaptive=False, progress=False)
    pool = sr.pool
    profile = load_or_sweep_profile(pool, progress=False)
    systems = [NativeSystem(pool, "target-only", (pool.target,), None),
               # chains only (trees="off"): SR-base's router class is another checkout's, which
               # never gets a tree policy, and a static runs its chain: plan for plan
               AdaptiveSystem(pool, "SpecRouter", profile=profile, progress=False, router_config=config, trees="off")]
    for spec in args.statics:
        chain, _, k = spec.partition(":")
        try:
            models = pool.validate_chain(chain.split(">"))  # roles ("draft", "target") resolved
        except ChainError as e:
            ap.error(f"--statics {spec!r}: {e}")
        if len(models) < 2 or not (k or "4").isdigit() or int(k or 4) < 1:
            ap.error(f"--statics {spec!r}: expected a drafting chain ending at the target, chain>...>target[:k], k >= 1")
        systems.append(NativeSystem(pool, spec, models, int(k or 4)))
    if base is not None:
        systems.append(BaseRouterSystem(pool, "SR-base", *base, profile=profile, progress=False, router_config=config))
    marked = {(tuple(s.chain), s.k or 0): s.name for s in systems if s.name in args.statics}
    for s in systems:
        s.reset()
        s.run(sr.encode("hello"), Decoding(0.0, 8, 0))  # first forwards allocate
        instrument(s, TIMERS, marked)
    cfg = BenchConfig(workloads=(args.workload,), prompts_per_type=args.prompts_per_type,
                      temperatures=(args.temperature,), slowdown=False, hf="none", peers=False, controls=controls)
    scenario = build_scenarios(cfg)[0]
    totals = defaultdict(lambda: [0, 0.0])
    same = 0  # requests whose SpecRouter and SR-base outputs were the same
    # the thread's torch threads cut while another process took a core (engine/contention.py):
    # such a system's forwards ran slower for a while, a co-tenant's doing and not its own
    governor, drops = thread_governor(), defaultdict(int)
    n = len(systems)
    for i, req in enumerate(scenario.workload.requests):
        ids = sr.encode(req.prompt, chat=req.chat)
        dec = Decoding(args.temperature, cfg.max_new_tokens, cfg.seed + i, controls)
        outs = {}
        for s in systems[i % n:] + systems[:i % n]:
            d0 = governor.drops
            out = s.run(ids, dec)
            drops[s.name] += governor.drops - d0
            outs[s.name] = list(out.token_ids)
            totals[s.name][0] += len(out.token_ids)
            totals[s.name][1] += out.seconds
        same += outs["SpecRouter"] == outs.get("SR-base")
    print(f"{scenario.name}, t={args.temperature:g}: tokens/s " + ", ".join(
        f"{n} {t / s:.1f}" for n, (t, s) in totals.items()))
    if any(drops.values()):
        print("torch threads cut for a co-tenant (TeamGovernor drops) during: "
              + ", ".join(f"{name} {n}" for name, n in drops.items() if n))
    rate = {name: t / s for name, (t, s) in totals.items()}
    if base is not None:
        print(f"SpecRouter / target-only {rate['SpecRouter'] / rate['target-only']:.3f}, SR-base / target-only "
              f"{rate['SR-base'] / rate['target-only']:.3f}, SpecRouter / SR-base {rate['SpecRouter'] / rate['SR-base']:.3f}; "
              f"outputs the same in {same} of {len(scenario.workload.requests)} requests")
    print(f"{'ms per step':24s} {'steps':>6s} {'step':>6s} {'host':>6s} " + " ".join(f"{p[:12]:>12s}" for p in PARTS)
          + " " + " ".join(f"{p:>13s}" for p in ("engine_plan", "engine_report", "collect")) + f" {'other':>7s}")
    for key, n in sorted(TIMERS.steps.items()):
        ms = {p: 1e3 * TIMERS.seconds[(key, p)] / n for p in ("step", *PARTS, *ENGINE)}
        own = {"engine_plan": ms["_plan_step"] - ms["plan_batch"] - ms["confident_offers"],
               "engine_report": ms["_report"] - ms["observe_step"] - ms["judge_shadows"] - ms["tree_observe"],
               "collect": ms["_collect"]}
        other = ms["step"] - sum(ms[p] for p in PARTS) - sum(own.values())
        print(f"{key:24s} {n:6d} {ms['step']:6.2f} {ms['step'] - ms['executor']:6.3f} "
              + " ".join(f"{ms[p]:12.3f}" for p in PARTS) + " " + " ".join(f"{v:13.3f}" for v in own.values())
              + f" {other:7.3f}")
    for key, n in sorted(TIMERS.steps.items()):
        if key.startswith(("SpecRouter", "SR-base")):
            print(f"{key:24s} inside plan_batch, ms per step: " + " ".join(
                f"{p} {1e3 * TIMERS.seconds[(key, p)] / n:.3f}" for p in INSIDE))
    for key, inside in sorted(TIMERS.inside.items()):  # the same plan inside the executor, by system
        n = inside["steps"]
        print(f"{key:24s} inside the executor, {n:.0f} decode steps, ms per step: outside forwards "
              f"{1e3 * inside['outside forwards'] / n:.3f}; forwards (model #i width: ms, steps) " + ", ".join(
                  f"{name.split('-')[0]} {name.split(' ', 1)[1]}: {1e3 * v / inside[name + ' n']:.3f} ({inside[name + ' n']:.0f})"
                  for name, v in inside.items() if " #" in name and not name.endswith(" n")))
    for system in systems[1:]:
        router = system.sr.engine.router
        if router is None:  # a static chain
            continue
        stats = router.cache_stats
        print(f"{system.name} decision cache: hits {stats.hits}, misses {stats.misses} by changed key field "
              f"{stats.reasons}; evidence republished {router.board.publications}")
        print(f"{system.name} router: decisions cached {stats.hits} / {stats.hits + stats.misses}; overheads (ms): "
              + " ".join(f"{k} {1e3 * v:.3f}" for k, v in router.overhead.items())
              + f" decide {1e3 * router.decide_seconds:.3f}")


TIMERS = Timers()

if __name__ == "__main__":
    main()
