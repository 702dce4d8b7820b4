"""`specrouter profile`: this machine's cost profile of a pool (the embedded one by default)
and the router's predicted T_eff table (time per target token for every chain at its best
draft length, with the prior acceptance estimates)."""

from __future__ import annotations

import argparse

from specrouter.cli.options import add_pool_arguments, pool_config
from specrouter.cli.terminal import print_table


def cmd_profile(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from specrouter.models.pool import Pool
    from specrouter.router.policy import Router
    from specrouter.records.routing import RowContext
    from specrouter.router.setup import load_or_sweep_profile

    config = pool_config(args)
    if config.threads:
        torch.set_num_threads(config.threads)
    pool = Pool.from_config(config, progress=True)
    profile = load_or_sweep_profile(pool, path=config.profile_path, force=args.force, progress=True)
    ts = [1, 2, 4, 8, 16, 32]  # (32: swept where this machine makes it cheap, else extrapolated)
    rows = [[n, *(f"{profile.predict(n, args.batch, t, args.context) * 1e3:.2f}" for t in ts)]
            for n in pool.order]
    print_table(["model", *(f"t={t}" for t in ts)], rows,
                title=f"forward time in ms, T_M(b={args.batch}, t new tokens, L={args.context}), "
                      "cheapest model first")
    router = Router.from_pool(pool, profile)
    table = router.plan_table(RowContext(seq_id=-1, context_len=args.context, batch_size=args.batch,
                                         greedy=args.temperature == 0))
    plain = [i for i, c in enumerate(table.chains) if len(c) == 1]
    base = float(table.t_eff[plain[0], 0]) if plain else float("nan")
    rows = []
    for i, chain in enumerate(table.chains):
        j = int(np.argmin(table.t_eff[i]))
        t = float(table.t_eff[i, j])
        rows.append([" > ".join(chain), str(0 if len(chain) == 1 else int(table.ks[j])),
                     f"{t * 1e3:.2f}", f"{float(table.expected_tokens[i, j]):.2f}",
                     f"{base / t:.2f}x"])
    print_table(["chain", "best k", "T_eff ms/token", "tokens/cycle", "vs target-only"], rows,
                title="predicted time per target token, prior acceptance estimates "
                      f"({'greedy' if args.temperature == 0 else 'sampling'}); the router "
                      "refines them from what it observes")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile the pool's models and show the predicted T_eff table",
                       description=__doc__)
    p.add_argument("--force", action="store_true", help="sweep again even if a profile exists")
    p.add_argument("--batch", type=int, default=1, help="batch rows for the tables (default 1)")
    p.add_argument("--context", type=int, default=256, help="context length for the tables (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy acceptance estimates")
    add_pool_arguments(p, flags=("models", "target", "dtype", "backend", "no_ngram", "no_suffix", "threads",
                                 "profile_path", "device"))
    p.set_defaults(func=cmd_profile)
