"""The router's calls of a real engine run, recorded once and replayed on a fresh router
(issues 26, 31: the router's host seconds per step, and whether a change moved any decision).

    python benchmarks/router_replay.py record TRACE [--concurrency 1 4 8] [--temperature 0]
        [--requests 16] [--max-new-tokens 64]
    python benchmarks/router_replay.py replay TRACE [TRACE ...] [--repeat 3] [--digest] [--set FIELD=VALUE ...]
        [--evict MB]

`record` runs the serving bench's mixed stream through the engine's own continuous batching
(the default pool, one router learning along every level, as `serve_engine.py`) and pickles the
router's construction (pool order, model-free drafters, sizes, its starting cost profile) and
every call the engine made to it, in order: plan_batch (row contexts, pinned plans),
take_confident_drafts, observe_step (the StepReport), finish_request, mark_failed, with the
values its step clock returned. `replay` builds a fresh router from it and makes the same calls
with the same reports (what a step committed is the recorded step's, whatever the replayed
router plans: its observations are the run's), and prints the host seconds per call by step
kind: speculative (the recorded step speculated) and held (planned by a hold) per batch size.
The step clock reads what it read in the run. `--digest`: the router's own timer (decide()'s
seconds, which it charges to plans) is made deterministic too (a counter), and a digest of
every plan it returned is printed: two versions of the router planned the same on the trace
when their digests are equal (`tests/test_router_replay.py`: a scripted
run's replay plans exactly what the run planned).

No torch model runs in `replay`: it measures the router alone, on the evidence of a real run.
`--evict MB` writes an MB-sized buffer before each plan_batch and observe_step call, as the
step's forwards do in the engine (they stream the models' weights through every cache level):
the router then runs from a cold cache, as it does there. Replayed warm, a decision cost ~0.3 ms
against ~0.9 ms in the engine; with `--evict 64` the replay reads what `router_overhead.py`
reads in the engine (Sapphire Rapids, lean19: observe_step 153 against 135-156 us, a decided
step 0.66-0.79 ms, a held one 0.07).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import hashlib
import itertools
import os
import pickle
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from specrouter.router.policy import Router


class Recorder:
    """Wraps a router's RouterProtocol methods: every call appended to `calls` (name, args,
    step-clock readings made during it)."""

    METHODS = ("plan_batch", "take_confident_drafts", "observe_step", "finish_request", "mark_failed")

    def __init__(self, router: Router):
        self.router, self.calls = router, []
        self.clock_reads: list[float] = []
        for name in self.METHODS:
            setattr(router, name, self._wrap(name, getattr(router, name)))

    def _wrap(self, name, fn):
        def recorded(*args):
            router = self.router
            clock, reads = router.step_clock, []
            if clock is not None:
                def reading():
                    v = clock()
                    reads.append(v)
                    return v
                router.step_clock = reading
            try:
                return fn(*args)
            finally:
                router.step_clock = clock
                self.calls.append((name, copy.deepcopy(args), reads))
        return recorded


def setup_of(router: Router) -> dict:
    """What `fresh_router` needs to build a router as `router` is now."""
    return {"order": list(router.order), "target": router.target, "model_free": sorted(router.model_free),
            "first_only": sorted(router.first_only - router.model_free), "packed": sorted(router.packed),
            "sizes": dict(router.similarity.sizes) if getattr(router.similarity, "sizes", None) else None,
            "profile": copy.deepcopy(router.profile), "similarity": copy.deepcopy(router.similarity),
            "config": router.config, "clock": router.step_clock is not None}


def record(args) -> None:
    import torch

    from specrouter.bench.serve import continuous_batching
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.router.setup import build_router

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_engine import load_stream, run

    torch.set_grad_enabled(False)
    pool, ids, max_len = load_stream(args.requests, args.concurrency, args.max_new_tokens)
    n_req = len(ids)
    router = build_router(pool, progress=False)
    setup = setup_of(router)
    rec = Recorder(router)  # from its first call (the warm-ups' too)
    for c in args.concurrency:
        view = pool.with_fresh_drafters()
        engine = Engine(view, max_num_seqs=c, max_model_len=max_len, router=router)
        warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        continuous_batching(engine, [x[:8] for x in ids[:c]], warm, c, None)
        params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=True, seed=i) for i in range(n_req)]
        t0 = time.perf_counter()
        seqs = run(engine, ids, params, c, None)
        wall = time.perf_counter() - t0
        print(f"c={c}: {sum(len(s.output_ids) for s in seqs) / wall:.1f} tok/s (recording), load {os.getloadavg()[0]:.2f}",
              flush=True)
    with open(args.trace, "wb") as f:
        pickle.dump({"setup": setup, "calls": rec.calls}, f)
    print(f"{len(rec.calls)} calls -> {args.trace}")


def fresh_router(setup: dict, deterministic: bool, changes: dict | None = None) -> Router:
    """A router as the recorded one started (its profile and estimates as they were at the
    first call); `changes`: RouterConfig fields replaced (a variant replayed on the same calls)."""
    clock = itertools.count()
    kwargs = {"timer": (lambda: next(clock) * 1e-5)} if deterministic else {}
    config = dataclasses.replace(setup["config"], **changes) if changes else setup["config"]
    return Router(setup["order"], setup["target"], copy.deepcopy(setup["profile"]), copy.deepcopy(setup.get("similarity")),
                  model_free=setup["model_free"], first_only=setup["first_only"], packed=setup["packed"],
                  sizes=setup["sizes"], config=config,
                  step_clock=time.perf_counter if setup.get("clock", True) else None, **kwargs)


def replay(trace: dict, deterministic: bool = False, changes: dict | None = None,
           evict_mb: int = 0) -> tuple[dict, str]:
    """Replays the calls; returns ({(call, kind): [seconds]}, digest of the plans returned).
    `evict_mb`: a buffer that size written before each plan_batch and observe_step (module
    docstring)."""
    import numpy as np

    router = fresh_router(trace["setup"], deterministic, changes)
    buffer = np.zeros(evict_mb * 1024 * 1024 // 8) if evict_mb else None
    digest = hashlib.sha256()
    seconds: dict = defaultdict(list)
    kind = "?"
    perf = time.perf_counter
    for name, args, reads in trace["calls"]:
        if router.step_clock is not None:
            it = iter(reads)
            router.step_clock = lambda: next(it)  # the engine's busy clock as it read during the call
        fn = getattr(router, name)
        if buffer is not None and name in ("plan_batch", "observe_step"):
            np.add(buffer, 1.0, out=buffer)
        t0 = perf()
        out = fn(*args)
        dt = perf() - t0
        if name == "plan_batch":
            n = len(args[0]) + (len(args[1]) if len(args) > 1 else 0)
            held = router.outside._last is not None and router.outside._last.held
            kind = f"{'held' if held or out.held else 'planned'} rows={n}"
            digest.update(repr([(d.chain, d.k, d.reason, round(d.t_eff, 12) if d.t_eff == d.t_eff else None,
                                 round(d.min_confidence, 12)) for d in out.decisions]).encode())
            digest.update(repr((out.held, out.shadow_k, out.steps)).encode())
        elif name == "take_confident_drafts":
            digest.update(repr(out).encode())
        elif name == "observe_step":
            report = args[0]
            step = "spec" if report.speculative else "plain"
            seconds[("observe_step", f"{step} rows={len(report.outcomes)}")].append(dt)
            continue
        seconds[(name, kind)].append(dt)
    return seconds, digest.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("trace")
    rec.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--requests", type=int, default=16)
    rec.add_argument("--max-new-tokens", type=int, default=64)
    rep = sub.add_parser("replay")
    rep.add_argument("traces", nargs="+")
    rep.add_argument("--repeat", type=int, default=3, help="replays timed (the median of each call's mean)")
    rep.add_argument("--digest", action="store_true", help="deterministic timer and clock; print the plans' digest")
    rep.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                     help="RouterConfig fields changed for the replay (a Python literal: stream_hold_steps=4)")
    rep.add_argument("--evict", type=int, default=0, metavar="MB",
                     help="write an MB buffer before each plan_batch / observe_step: a cold cache, as in the engine")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args)
        return 0
    changes = {k: ast.literal_eval(v) for k, _, v in (s.partition("=") for s in args.set)}
    for path in args.traces:
        with open(path, "rb") as f:
            trace = pickle.load(f)
        if args.digest:
            print(f"{path}: plans digest {replay(trace, True, changes)[1]}")
            continue
        runs = [replay(trace, False, changes, args.evict)[0] for _ in range(args.repeat)]
        print(f"{path}: {len(trace['calls'])} calls, load {os.getloadavg()[0]:.2f}; us per call "
              f"(median over {args.repeat} replays of the mean), calls" + (f"; evicting {args.evict} MB" if args.evict else ""))
        for key in sorted(runs[0]):
            means = [1e6 * statistics.fmean(r[key]) for r in runs if r.get(key)]
            print(f"  {key[0]:22s} {key[1]:18s} {statistics.median(means):8.1f} us  x{len(runs[0][key])}")
        steps = {k: statistics.median(1e3 * sum(r[k]) for r in runs if r.get(k)) for k in runs[0]}
        by_rows: dict = defaultdict(lambda: [0.0, 0])
        for (name, kind), ms in steps.items():
            rows = kind.rsplit("rows=", 1)[-1]
            by_rows[rows][0] += ms
            if name == "observe_step":
                by_rows[rows][1] += len(runs[0][(name, kind)])
        print("  router ms per observed step, by rows: " + ", ".join(
            f"{rows} rows {ms / n:.3f} (x{n})" for rows, (ms, n) in sorted(by_rows.items()) if n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
