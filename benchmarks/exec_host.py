"""The executor's host time outside the model forwards, per step kind (issues 26, 28, 31).

Static chains (the default pool, no router): `draft>target` at each k of `--ks` and plain
decoding, greedy and at each temperature of `--temperatures`, 1 row and `--rows` rows, on the
mixed stream's prompts (`bench/serve.py prompts`). Per configuration: tokens/s, the executor's
wall ms per step, its forwards' ms per step (draft / target) and the host ms per step outside
them (wall - forwards: batch building, sampling, verification, bookkeeping, commit), medians
over the timed steps. With `--profile`, a cProfile of the executor steps of one configuration
(`--profile "draft>target" 2 0.7 4`: chain, k, temperature, rows) sorted by own time.

    python benchmarks/exec_host.py [--ks 2 4] [--temperatures 0 0.7] [--rows 1 4]
        [--max-new-tokens 64] [--requests 4] [--repeat 1] [--profile CHAIN K T ROWS]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from specrouter.api import SpecRouter
from specrouter.bench.serve import prompts
from specrouter.config import PoolConfig, SamplingParams
from specrouter.engine.engine import Engine
from specrouter.models.default_pool import default_pool_paths
from specrouter.models.pool import Pool, preview_pool


def run_config(pool, ids, chain, k, temperature, rows, max_new, profile=None):
    """Every request of `ids` in batches of `rows` (static `chain`, `k`); per-step records."""
    max_len = max(len(x) for x in ids) + max_new + 16
    view = pool.with_fresh_drafters()
    engine = Engine(view, max_num_seqs=rows, max_model_len=max_len, prefix_cache=False)
    steps = []
    execute = engine.executor.step

    def timed(*a, **kw):
        if profile is not None:
            profile.enable()
        out = execute(*a, **kw)
        if profile is not None:
            profile.disable()
        steps.append(out)
        return out

    engine.executor.step = timed
    # warm-up: one batch, few tokens
    warm = SamplingParams(temperature=temperature, max_new_tokens=8, ignore_eos=True, seed=99)
    engine.generate_ids([ids[0]] * rows, [warm] * rows, chain=chain, k=k)
    steps.clear()
    tokens, t0 = 0, time.perf_counter()
    outs = []
    for s in range(0, len(ids), rows):
        batch = ids[s:s + rows]
        if len(batch) < rows:
            break
        params = [SamplingParams(temperature=temperature, max_new_tokens=max_new, ignore_eos=True, seed=s + i)
                  for i in range(len(batch))]
        seqs = engine.generate_ids(batch, params, chain=chain, k=k)
        tokens += sum(len(q.output_ids) for q in seqs)
        outs += [q.output_ids for q in seqs]
    wall = time.perf_counter() - t0
    target, draft = pool.target, chain[0]
    full = [r for r in steps if len(r.outcomes) == rows]  # steps with every row (not a batch's tail)
    med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    spec = [r for r in full if r.speculative]
    return {
        "tok/s": tokens / wall,
        "steps": len(full),
        "wall": med([r.wall_time for r in full]),
        "draft": med([r.forward_time.get(draft, 0.0) for r in full]) if len(chain) > 1 else 0.0,
        "target": med([r.forward_time.get(target, 0.0) for r in full]),
        "host": med([r.wall_time - sum(r.forward_time.values()) for r in full]),
        "host_spec": med([r.wall_time - sum(r.forward_time.values()) for r in spec]),
        "host_mean": statistics.fmean([r.wall_time - sum(r.forward_time.values()) for r in full]) * 1e3 if full else float("nan"),
        "draft_host": med([r.draft_host_seconds for r in spec]),
        "outs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--profile", nargs=4, metavar=("CHAIN", "K", "T", "ROWS"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pcfg = PoolConfig(models=tuple(str(p) for p in default_pool_paths()))
    pool = Pool.from_config(pcfg, paths=list(preview_pool(pcfg).paths))
    sr = SpecRouter(pool)
    draft = pool.model_drafts[0]
    print(f"pool order {pool.order}; cpu {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    if args.profile:
        chain = tuple(pool.target if m == "target" else draft if m == "draft" else m
                      for m in args.profile[0].split(">"))
        k, t, rows = int(args.profile[1]), float(args.profile[2]), int(args.profile[3])
        ids = [sr.encode(p, chat=c) for p, c in prompts(max(args.requests, rows))]
        prof = cProfile.Profile()
        res = run_config(pool, ids, chain, k, t, rows, args.max_new_tokens, profile=prof)
        print({k_: round(v, 3) for k_, v in res.items() if k_ != "outs"})
        pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("NSTATS", "45")))
        return
    configs = []
    for rows in args.rows:
        for t in args.temperatures:
            if not args.no_plain:
                configs.append(((pool.target,), 1, t, rows))
            for k in args.ks:
                configs.append(((draft, pool.target), k, t, rows))
    for rep in range(args.repeat):
        ref = {}
        for chain, k, t, rows in configs:
            ids = [sr.encode(p, chat=c) for p, c in prompts(max(args.requests, rows))]
            r = run_config(pool, ids, chain, k, t, rows, args.max_new_tokens)
            key = (t, rows)
            same = ""
            if key in ref:
                same = " same-output" if ref[key] == r["outs"] else " OUTPUT DIFFERS"
            else:
                ref[key] = r["outs"]
            print(f"rep {rep} {'>'.join(chain):22s} k={k} t={t} rows={rows}: {r['tok/s']:6.1f} tok/s "
                  f"steps={r['steps']} wall={r['wall']:.2f} draft={r['draft']:.2f} target={r['target']:.2f} "
                  f"host={r['host']:.3f} (mean {r['host_mean']:.3f}, spec {r['host_spec']:.3f}, draft-step host {r['draft_host']:.3f}) ms"
                  f"{same}  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
