"""`specrouter` command line: generate | serve | profile | bench | distill | demo."""

from __future__ import annotations

import argparse
import sys
import time

from specrouter.errors import SpecRouterError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 disables nucleus sampling")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")


def _print_result(res, prompt_label: str) -> None:
    s = res.stats
    print(f"--- {prompt_label}")
    print(res.text)
    rates = ", ".join(f"{p}: {r:.2f}" for p, r in s.acceptance_rates.items()) or "n/a"
    chains = ", ".join(f"{c} x{n}" for c, n in s.chains.items())
    print(f"[{s.generated} tokens, {s.tokens_per_second:.1f} tok/s, chain {chains}, "
          f"acceptance {rates}, mean acceptance length {s.mean_acceptance_length:.2f}, "
          f"finish {res.finish_reason}]")


def cmd_generate(args: argparse.Namespace) -> int:
    from specrouter.api import SpecRouter

    paths = list(args.models)
    sr = SpecRouter.from_pretrained(paths, target=args.target, backend=args.backend,
                                    dtype=args.dtype, ngram=not args.no_ngram, suffix=not args.no_suffix,
                                    progress=True,
                                    adaptive=not args.static and not args.chain)
    print(f"pool (cheapest first): {' < '.join(sr.pool.order)}; target: {sr.pool.target}",
          file=sys.stderr)
    prompts = args.prompt or [sys.stdin.read()]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, chat=args.chat)
    chain = tuple(args.chain) if args.chain else None
    t0 = time.perf_counter()
    results = sr.generate(prompts, chain=chain, k=args.k, **kw)
    spec_time = time.perf_counter() - t0
    for i, res in enumerate(results):
        _print_result(res, f"prompt {i}")
    if args.compare:
        t0 = time.perf_counter()
        base = sr.generate(prompts, chain=(sr.pool.target,), **kw)
        base_time = time.perf_counter() - t0
        same = all(a.token_ids == b.token_ids for a, b in zip(results, base))
        n_spec = sum(r.stats.generated for r in results)
        n_base = sum(r.stats.generated for r in base)
        print(f"speculative {n_spec / spec_time:.1f} tok/s vs target-only {n_base / base_time:.1f} "
              f"tok/s: {n_spec / spec_time / (n_base / base_time):.2f}x"
              + (f"; greedy output identical: {same}" if args.temperature == 0 else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrouter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with a pool of models")
    g.add_argument("--models", nargs="+", required=True,
                   help="checkpoint directories or .gguf files (\"ngram\" is added unless --no-ngram)")
    g.add_argument("--target", default=None, help="target name or path (default: the largest model)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable; default: stdin)")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the target's chat template")
    g.add_argument("--chain", nargs="+", default=None,
                   help="pin a static chain, e.g. --chain ngram draft target (default: the router "
                        "picks chain and draft length per request every cycle)")
    g.add_argument("--k", type=int, default=4, help="draft length of a pinned --chain")
    g.add_argument("--static", action="store_true", help="no router: the pool's default chain")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float64")
    g.add_argument("--backend", default="auto", help="auto | native | hf")
    g.add_argument("--no-ngram", action="store_true", help="do not add the n-gram drafter")
    g.add_argument("--no-suffix", action="store_true", help="do not add the suffix drafter")
    g.add_argument("--compare", action="store_true", help="also run target-only and print the speedup")
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)

    from specrouter.cli import bench as cli_bench
    from specrouter.cli import demo as cli_demo
    from specrouter.cli import distill as cli_distill
    from specrouter.cli import profile as cli_profile
    from specrouter.cli import serve as cli_serve

    cli_bench.register(sub)
    cli_demo.register(sub)
    cli_distill.register(sub)
    cli_serve.register(sub)
    cli_profile.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecRouterError as e:
        print(f"specrouter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
