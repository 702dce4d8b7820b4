"""`specrouter profile`: this machine's cost profile of a pool and the router's predicted
T_eff table (seconds per target token for every chain and draft length)."""

from __future__ import annotations

import argparse


def cmd_profile(args: argparse.Namespace) -> int:
    from specrouter.models.pool import Pool
    from specrouter.router.policy import Router
    from specrouter.router.records import RowContext
    from specrouter.router.setup import load_or_sweep_profile

    pool = Pool.load(list(args.models), target=args.target, dtype=args.dtype, ngram=not args.no_ngram,
                     suffix=not args.no_suffix,
                     progress=True)
    profile = load_or_sweep_profile(pool, path=args.profile_path, force=args.force, progress=True)
    names = pool.order
    ts = [1, 2, 4, 8, 16]
    print(f"forward time T_M(b={args.batch}, t, L={args.context}) in ms, cheapest model first")
    print(f"{'model':<32}" + "".join(f"{'t=' + str(t):>10}" for t in ts))
    for n in names:
        row = [profile.predict(n, args.batch, t, args.context) * 1e3 for t in ts]
        print(f"{n:<32}" + "".join(f"{x:>10.2f}" for x in row))
    router = Router.from_pool(pool, profile)
    table = router.plan_table(RowContext(seq_id=-1, context_len=args.context, batch_size=args.batch,
                                         greedy=args.temperature == 0))
    print(f"\npredicted T_eff (ms per target token) with the prior acceptance estimates "
          f"({'greedy' if args.temperature == 0 else 'sampling'}):")
    print(table.format())
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile the pool's models and show the predicted T_eff table")
    p.add_argument("--models", nargs="+", required=True, help="checkpoint directories or .gguf files")
    p.add_argument("--target", default=None, help="target name or path (default: the largest)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-ngram", action="store_true", help="leave the n-gram drafter out")
    p.add_argument("--no-suffix", action="store_true", help="leave the suffix drafter out")
    p.add_argument("--force", action="store_true", help="sweep again even if a profile exists")
    p.add_argument("--profile-path", default=None, help="profile file (default: the cache dir)")
    p.add_argument("--batch", type=int, default=1, help="batch rows for the table")
    p.add_argument("--context", type=int, default=256, help="context length for the table")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy acceptance estimates")
    p.set_defaults(func=cmd_profile)
