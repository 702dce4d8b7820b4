"""`specrouter demo`: the embedded default pool doing its real job, measured side by side."""

from __future__ import annotations

import argparse
import time

from specrouter.cli.options import add_engine_arguments, add_pool_arguments, engine_config, pool_config
from specrouter.cli.terminal import STATS_LEGEND

DEMO_PROMPTS = [
    # (kind, prompt, use the chat template)
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("chat", "What are three good habits for staying healthy? Answer briefly.", True),
    ("prose", "Write a short story about a lighthouse keeper who finds a message in a bottle.", True),
    ("extraction", "Repeat this list exactly, one item per line: apples, bananas, cherries, "
                   "dates, elderberries, figs, grapes.", True),
]


def cmd_demo(args: argparse.Namespace) -> int:
    from specrouter.api import SpecRouter
    from specrouter.config import SpecRouterConfig

    config = SpecRouterConfig(pool=pool_config(args), engine=engine_config(args))
    t0 = time.perf_counter()
    sr = SpecRouter.from_config(config, progress=True)
    pool = sr.pool
    print(f"pool (cheapest first): {' < '.join(pool.order)}; target: {pool.target} "
          f"(loaded in {time.perf_counter() - t0:.1f}s)")
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
    # warm-up: first forwards allocate
    sr.generate("Hello", max_new_tokens=4)
    sr.generate("Hello", max_new_tokens=4, chain=(pool.target,))
    tot_spec = tot_base = 0.0
    n_spec = n_base = 0
    identical = True
    for kind, prompt, chat in DEMO_PROMPTS:
        t = time.perf_counter()
        base = sr.generate(prompt, chain=(pool.target,), chat=chat, **kw)[0]
        tb = time.perf_counter() - t
        t = time.perf_counter()
        res = sr.generate(prompt, chat=chat, **kw)[0]
        ts = time.perf_counter() - t
        tot_base, tot_spec = tot_base + tb, tot_spec + ts
        n_base, n_spec = n_base + len(base.token_ids), n_spec + len(res.token_ids)
        same = base.token_ids == res.token_ids
        identical &= same
        s = res.stats
        print(f"\n=== {kind}: {prompt[:70]!r}")
        print(res.text.strip())
        rates = ", ".join(f"{p} {r:.0%}" for p, r in s.acceptance_rates.items()) or "n/a"
        print(f"--- chain {', '.join(s.chains)} | per-token acceptance {rates} | mean acceptance "
              f"length {s.mean_acceptance_length:.2f} tokens/cycle | {len(res.token_ids) / ts:.1f} tok/s vs "
              f"target-only {len(base.token_ids) / tb:.1f} tok/s = {tb / ts * len(res.token_ids) / max(1, len(base.token_ids)):.2f}x"
              f" | identical to target-only greedy: {same}")
    speed = (n_spec / tot_spec) / (n_base / tot_base)
    print(f"\nall prompts: SpecRouter {n_spec / tot_spec:.1f} tok/s vs target-only "
          f"{n_base / tot_base:.1f} tok/s = {speed:.2f}x; greedy output identical: {identical}")
    print(f"({STATS_LEGEND}; tok/s include the prefill)")
    return 0 if identical else 1


def register(sub) -> None:
    d = sub.add_parser("demo", help="run the embedded default pool on a few prompts, vs target-only",
                       description=__doc__)
    d.add_argument("--max-new-tokens", type=int, default=96, help="tokens per reply (default 96)")
    add_engine_arguments(d, k_help="draft length of a pinned --chain or of --static (default 4)")
    add_pool_arguments(d)
    d.set_defaults(func=cmd_demo)
