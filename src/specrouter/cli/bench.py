"""`specrouter bench`: SpecRouter side by side with target-only decoding, transformers generate
and assisted generation, every static chain at its best k and the per-request oracle, on code,
prose, chat, extraction and a mixed stream (greedy and t=0.7), plus a run with a scripted
slowdown of one model. Writes bench.json, bench.md and PNG plots to --out-dir; greedy outputs
of the static chains and SpecRouter are checked identical to target-only (exit 2 otherwise)."""

from __future__ import annotations

import argparse
import sys
import time

from specrouter.cli.options import add_pool_arguments, pool_config
from specrouter.cli.terminal import print_markdown
from specrouter.config import DEFAULT_POOL

# the pool flags the bench takes (it compares chains of the whole pool, with and without n-gram)
BENCH_POOL_FLAGS = ("models", "target", "dtype", "threads", "profile_path", "device")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags left unset keep BenchConfig's defaults (or --quick's)."""
    p.add_argument("--serve", action="store_true",
                   help="serving benchmark: a live `specrouter serve` on 127.0.0.1 driven by the openai "
                        "async client at --concurrency levels; router vs plain continuous batching vs "
                        "static chains (serve.json, serve.md, serve.png)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="--serve: concurrent clients per level (default 1 2 4 8 16)")
    p.add_argument("--requests", type=int, default=None,
                   help="--serve: requests per system per level (default 16)")
    p.add_argument("--fresh-rounds", type=int, default=None, metavar="N",
                   help="--serve: issue 34's lines instead (the server beside the Python API at c=1 and the "
                        "engine's batching at each --concurrency >= 4), N rounds each on fresh server and "
                        "library processes, verdict the median of per-round ratios (serve-fresh.json, "
                        "serve-fresh.md)")
    p.add_argument("--stream-interval", type=int, default=None, metavar="STEPS",
                   help="--serve: the servers' --stream-interval (default: specrouter serve's)")
    p.add_argument("--no-team-governor", action="store_true",
                   help="--serve: the servers keep their torch threads under contention (serve --no-team-governor)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (meant for < 3 min on 2 quiet cores): mixed stream only, "
                        "1 prompt per type, 32 new tokens, k=4 only, transformers baselines in "
                        "the greedy run only")
    p.add_argument("--out-dir", default=None, help="output folder (default: bench-out)")
    p.add_argument("--workloads", nargs="+", default=None,
                   help="some of: code prose chat extraction mixed templated multiturn structured (default: code "
                        "prose chat extraction mixed); with --serve: mixed (default) and/or shared-prompt (clients "
                        "sharing a ~300-token system prompt, prefix cache on vs off servers, side by side)")
    p.add_argument("--kinds", nargs="+", default=None,
                   help="request types of the mixed stream, in order (default: extraction prose code chat)")
    p.add_argument("--prompts-per-type", type=int, default=None, help="default 3 (1..6)")
    p.add_argument("--prompt-set", choices=["original", "fresh28"], default=None,
                   help="the code/prose/chat/extraction prompts: original (default; every earlier figure) or "
                        "fresh28 (held out from the drafts' training prompts; docs/benchmarks.md)")
    p.add_argument("--mixed-block", type=int, default=None,
                   help="the mixed stream changes type every N requests (default 2)")
    p.add_argument("--repeat", type=int, default=None,
                   help="passes over each workload (default 1); --serve: rounds of router and plain per "
                        "level, alternating which runs first (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64")
    p.add_argument("--temperatures", type=float, nargs="+", default=None, help="default: 0 0.7")
    p.add_argument("--ks", type=int, nargs="+", default=None,
                   help="draft lengths of the static chains, best per chain in hindsight (default 2 4 8)")
    p.add_argument("--max-levels", type=int, default=None, help="deepest static chain (default 3)")
    p.add_argument("--hf", choices=["all", "greedy", "none"], default=None,
                   help="where the transformers baselines run (default all; --quick: greedy)")
    p.add_argument("--hf-assistant", default=None, help="draft of assisted generation (default: the largest)")
    p.add_argument("--no-slowdown", action="store_true", help="leave out the scripted-slowdown run")
    p.add_argument("--slowdown-model", default=None, help="model slowed (default: the largest draft)")
    p.add_argument("--slowdown-factor", type=float, default=None, help="default 4")
    p.add_argument("--slowdown-at", type=float, default=None,
                   help="fraction of the stream where the slowdown starts (default 0.5)")
    p.add_argument("--seed", type=int, default=None, help="request i samples with seed + i (default 0)")
    p.add_argument("--no-plots", action="store_true", help="no PNGs (no matplotlib needed)")
    for flag, what in (("--presence-penalty", "OpenAI's presence penalty"),
                       ("--frequency-penalty", "OpenAI's frequency penalty"),
                       ("--repetition-penalty", "vLLM's repetition penalty"),
                       ("--min-p", "vLLM's min_p")):
        p.add_argument(flag, type=float, default=None,
                       help=f"{what} on every request (native systems only: transformers and "
                            "llama.cpp rows are left out)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="leave out 'target-only +cache' and 'SpecRouter +cache' (the prefix cache on; "
                        "every other system runs without it)")
    p.add_argument("--plain-path", default=None, metavar="PATH",
                   help="where the target-only row decodes: auto (default: the kernel path with the fastest "
                        "1-token step, timed at start; SpecRouter's own path then stays as the greedy "
                        "reference), process (SpecRouter's path), or a kernel path name")
    p.add_argument("--no-peers", action="store_true",
                   help="leave out the llama.cpp rows (they need the peers extra: pip install 'specrouter[peers]')")
    add_pool_arguments(p, flags=BENCH_POOL_FLAGS)


def config_from_args(args: argparse.Namespace):
    from specrouter.bench import BenchConfig

    pool = pool_config(args)
    over = {"dtype": pool.dtype, "device": pool.device}
    if pool.models != (DEFAULT_POOL,):
        over["models"] = pool.models
    for field in ("target", "out_dir", "threads", "prompts_per_type", "prompt_set", "mixed_block",
                  "repeat", "max_new_tokens", "max_levels", "hf", "hf_assistant", "slowdown_model",
                  "slowdown_factor", "slowdown_at", "seed", "profile_path", "plain_path"):
        if getattr(args, field) is not None:
            over[field] = getattr(args, field)
    for field in ("workloads", "kinds", "temperatures", "ks"):
        if getattr(args, field) is not None:
            over[field] = tuple(getattr(args, field))
    if args.no_slowdown:
        over["slowdown"] = False
    if args.no_plots:
        over["plots"] = False
    if args.no_peers:
        over["peers"] = False
    if args.no_prefix_cache:
        over["prefix_cache"] = False
    controls = tuple((f, getattr(args, f)) for f in ("presence_penalty", "frequency_penalty",
                                                     "repetition_penalty", "min_p")
                     if getattr(args, f, None) is not None)
    if controls:
        over["controls"] = controls
    return BenchConfig.quick_preset(**over) if args.quick else BenchConfig(**over)


SERVE_WORKLOADS = ("mixed", "shared-prompt")  # --serve --workloads: the mixed stream, a shared system prompt


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from specrouter.bench.serve import ServeBenchConfig

    if getattr(args, "prompt_set", None) is not None:  # the serve bench sends its own request mix (bench/serve.py)
        print("specrouter bench: error: --prompt-set applies to the in-process bench, not --serve", file=sys.stderr)
        return 2
    over = {}
    for field, name in (("threads", "threads"), ("dtype", "dtype"), ("target", "target"),
                        ("max_new_tokens", "max_new_tokens"), ("requests", "requests"), ("seed", "seed"),
                        ("repeat", "rounds"), ("fresh_rounds", "fresh_rounds"),
                        ("stream_interval", "stream_interval")):
        if getattr(args, field) is not None:
            over[name] = getattr(args, field)
    for field in ("models", "concurrency", "temperatures"):
        if getattr(args, field) is not None:
            over[field] = tuple(getattr(args, field))
    if args.ks:
        over["k"] = args.ks[0]
    if args.max_levels is not None:  # the deepest static chain
        over["static_levels"] = args.max_levels
    over["out_dir"] = args.out_dir or "bench-out/serve"
    if args.no_team_governor:
        over["team_governor"] = False
    over["plots"] = not args.no_plots
    workloads = args.workloads or ("mixed",)
    unknown = [w for w in workloads if w not in SERVE_WORKLOADS]
    if unknown:
        print(f"specrouter bench: error: --serve --workloads takes {', '.join(SERVE_WORKLOADS)}, "
              f"got {', '.join(unknown)}", file=sys.stderr)
        return 2
    if set(workloads) == {"shared-prompt"} and args.concurrency is None:
        over["concurrency"] = (8,)  # issue 29: 8 clients sharing a system prompt (else the highest level)
    cfg = ServeBenchConfig.quick_preset(**over) if args.quick else ServeBenchConfig(**over)
    if cfg.fresh_rounds > 0:
        return cmd_fresh_serve_bench(cfg)
    status = 0
    if "shared-prompt" in workloads:
        status = cmd_shared_prompt_bench(cfg)
    if "mixed" in workloads:
        status = max(status, cmd_mixed_serve_bench(cfg))
    return status


def report(cfg, run, write, markdown) -> int:
    """`run(cfg, log)` (its progress on stderr), its files written by `write(result, out_dir)`, its
    `markdown(result)` printed; exit status 2 if greedy outputs differed."""
    t0 = time.perf_counter()
    result = run(cfg, log=lambda m: print(m, file=sys.stderr))
    paths = write(result, cfg.out_dir)
    print(markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - t0:.0f} s")
    return 2 if result["mismatches"] else 0


def cmd_shared_prompt_bench(cfg) -> int:
    from specrouter.bench.serve_shared import markdown_shared, run_shared_prompt_bench, write_shared

    return report(cfg, run_shared_prompt_bench, write_shared, markdown_shared)


def cmd_fresh_serve_bench(cfg) -> int:
    from specrouter.bench.serve_fresh import markdown_fresh, run_fresh_bench, write_fresh

    return report(cfg, run_fresh_bench, write_fresh, markdown_fresh)


def cmd_mixed_serve_bench(cfg) -> int:
    from specrouter.bench.serve import markdown, run_serve_bench, write

    return report(cfg, run_serve_bench, lambda result, out: write(result, out, cfg.plots), markdown)


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "serve", False):
        return cmd_serve_bench(args)
    from specrouter.bench.plots import make_plots
    from specrouter.bench.report import goals_table, peer_table, summary_table, write_report
    from specrouter.bench.run import run_bench

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"specrouter bench: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = run_bench(cfg, progress=True, log=lambda m: print(m, file=sys.stderr))
    paths = write_report(result, cfg.out_dir)
    pngs = make_plots(result, cfg.out_dir) if cfg.plots else []
    print_markdown(["", "## Tokens/s and ratios", "", *summary_table(result), "",
                    "## llama.cpp (peers)", "", *peer_table(result), "", "## Goals", "",
                    *goals_table(result["goals"])])
    print(f"wrote {paths['json']}, {paths['markdown']}" + "".join(f", {p}" for p in pngs)
          + f" in {time.perf_counter() - t0:.0f} s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmark: SpecRouter vs plain decoding, static "
                                     "chains, transformers assisted generation and the oracle",
                       description=__doc__)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
