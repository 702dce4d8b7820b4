"""`specrouter demo`: the embedded default pool doing its real job, measured side by side.

Honest by construction: SpecRouter and the target-only baseline each run on their own view of
the pool (`Pool.with_fresh_drafters()`), so neither learns from the other's output (the suffix
drafter learns from every finished request: on a shared pool, SpecRouter would replay the
baseline's answer). Which system runs first alternates from prompt to prompt. The baseline is
plain decoding on the kernel path with the fastest 1-token step (bench/plain_path.py); where
that is not SpecRouter's path, target-only on SpecRouter's path also runs, untimed, as the
reference its greedy output must equal (other kernels, other bits)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DemoRow:
    """One prompt, run by both systems."""

    kind: str
    prompt: str
    spec: object  # SpecRouter's GenerationResult
    base: object  # the target-only GenerationResult
    spec_seconds: float
    base_seconds: float
    spec_first: bool  # which system ran first on this prompt
    ref: object | None = None  # target-only on SpecRouter's path, where `base` ran on another

    @property
    def identical(self) -> bool:
        """SpecRouter's greedy tokens equal plain decoding's on the same kernel path."""
        return self.spec.token_ids == (self.ref or self.base).token_ids

    @property
    def speedup(self) -> float:
        """SpecRouter's tok/s over target-only's."""
        return (len(self.spec.token_ids) / self.spec_seconds) / max(1e-9, len(self.base.token_ids) / self.base_seconds)


def compare(sr, prompts, max_new_tokens: int, plain_runner=None):
    """Yield a `DemoRow` per (kind, prompt, chat) of `prompts`: `sr` (its router and its own
    drafters) against target-only plain decoding on a separate view of the same models with
    fresh drafters (the target `plain_runner` there, when given: the target on the fastest plain
    kernel path; then target-only on `sr`'s path runs too, as the greedy reference). Greedy; the
    first system alternates per prompt."""
    from specrouter.api import SpecRouter

    pool = sr.pool
    reference = SpecRouter(pool.with_fresh_drafters(), None, sr.config)
    baseline = reference if plain_runner is None else SpecRouter(pool.target_only_view(plain_runner),
                                                                 None, sr.config)
    target_only = (pool.target,)
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0)
    # warm-up (first forwards allocate), each system on its own view
    sr.generate("Hello", max_new_tokens=4)
    baseline.generate("Hello", max_new_tokens=4, chain=target_only)
    if reference is not baseline:
        reference.generate("Hello", max_new_tokens=4, chain=target_only)

    def run_spec(prompt, chat):
        t = time.perf_counter()
        res = sr.generate(prompt, chat=chat, **kw)[0]
        return res, time.perf_counter() - t

    def run_base(prompt, chat):
        t = time.perf_counter()
        res = baseline.generate(prompt, chain=target_only, chat=chat, **kw)[0]
        return res, time.perf_counter() - t

    for i, (kind, prompt, chat) in enumerate(prompts):
        spec_first = i % 2 == 1
        if spec_first:
            (spec, ts), (base, tb) = run_spec(prompt, chat), run_base(prompt, chat)
        else:
            (base, tb), (spec, ts) = run_base(prompt, chat), run_spec(prompt, chat)
        ref = None if reference is baseline else reference.generate(prompt, chain=target_only, chat=chat, **kw)[0]
        for name, res in (("SpecRouter", spec), ("target-only", base), ("the greedy reference", ref)):
            if res is not None and res.finish_reason == "error":  # a figure from a failed row is no figure
                raise RuntimeError(f"{name} failed on the {kind} prompt (finish_reason 'error'): see the log")
        yield DemoRow(kind, prompt, spec, base, ts, tb, spec_first, ref)


def cmd_demo(args: argparse.Namespace) -> int:
    from specrouter.api import SpecRouter
    from specrouter.config import SpecRouterConfig

    config = SpecRouterConfig(pool=pool_config(args), engine=engine_config(args))
    t0 = time.perf_counter()
    sr = SpecRouter.from_config(config, progress=True)
    pool = sr.pool
    print(f"pool (cheapest first): {' < '.join(pool.order)}; target: {pool.target} "
          f"(loaded in {time.perf_counter() - t0:.1f}s)")
    print("each system on its own view of the pool (no shared learning state); the first to run "
          "alternates per prompt")
    from specrouter.bench.plain_path import fastest_plain_path

    plain = fastest_plain_path(pool, log=print)  # target-only: the fastest plain decoding here
    rows = []
    speculated = False
    for row in compare(sr, DEMO_PROMPTS, args.max_new_tokens, plain.runner if plain else None):
        rows.append(row)
        s = row.spec.stats
        speculated |= bool(s.acceptance_rates)
        print(f"\n=== {row.kind}: {row.prompt[:70]!r}")
        print(row.spec.text.strip())
        rates = ", ".join(f"{p} {r:.0%}" for p, r in s.acceptance_rates.items()) or "n/a"
        first = "SpecRouter" if row.spec_first else "target-only"
        same = f" on {plain.process_path}" if plain is not None and plain.runner is not None else ""
        print(f"--- chain {', '.join(s.chains)} | per-token acceptance {rates} | mean acceptance "
              f"length {s.mean_acceptance_length:.2f} tokens/cycle | "
              f"{len(row.spec.token_ids) / row.spec_seconds:.1f} tok/s vs target-only "
              f"{len(row.base.token_ids) / row.base_seconds:.1f} tok/s = {row.speedup:.2f}x "
              f"({first} ran first) | identical to target-only greedy{same}: {row.identical}")
    n_spec = sum(len(r.spec.token_ids) for r in rows)
    n_base = sum(len(r.base.token_ids) for r in rows)
    t_spec = sum(r.spec_seconds for r in rows)
    t_base = sum(r.base_seconds for r in rows)
    identical = all(r.identical for r in rows)
    print(f"\nall prompts: SpecRouter {n_spec / t_spec:.1f} tok/s vs target-only "
          f"{n_base / t_base:.1f} tok/s = {(n_spec / t_spec) / (n_base / t_base):.2f}x; "
          f"greedy output identical: {identical}")
    print(f"({STATS_LEGEND + '; ' if speculated else ''}tok/s include the prefill)")
    return 0 if identical else 1


def register(sub) -> None:
    d = sub.add_parser("demo", help="run the embedded default pool on a few prompts, vs target-only",
                       description=__doc__)
    d.add_argument("--max-new-tokens", type=int, default=96, help="tokens per reply (default 96)")
    add_engine_arguments(d, k_help="draft length of a pinned --chain or of --static (default 4)")
    add_pool_arguments(d)
    d.set_defaults(func=cmd_demo)
