"""`specrouter generate`: text from a pool (the embedded one by default), streamed as each cycle
commits its tokens; the reply's statistics after it (on stderr); `--compare` also runs the
target alone and prints the speed-up."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

from specrouter.cli.options import (
    UsageError,
    add_engine_arguments,
    add_pool_arguments,
    add_sampling_arguments,
    engine_config,
    pool_config,
    sampling_params,
)
from specrouter.cli.terminal import STATS_LEGEND, stats_line
from specrouter.config import SamplingParams, SpecRouterConfig


def config_from_args(args: argparse.Namespace) -> tuple[SpecRouterConfig, SamplingParams]:
    """The configuration and sampling parameters of the flags, checked before any model loads."""
    config = SpecRouterConfig(pool=pool_config(args), engine=engine_config(args))
    params = sampling_params(args)
    spec = grammar_from_files(getattr(args, "json_schema", None), getattr(args, "grammar", None))
    return config, dataclasses.replace(params, grammar=spec) if spec is not None else params


def grammar_from_files(schema_file: str | None, grammar_file: str | None):
    """The GrammarSpec of --json-schema FILE (a JSON schema) or --grammar FILE (Lark), or None;
    a file that cannot be read or parsed is a UsageError naming it (the schema compiles when
    the pool's tokenizer is loaded)."""
    from pathlib import Path

    from specrouter.api import grammar_spec
    from specrouter.decoding.grammar import GrammarError

    if schema_file is None and grammar_file is None:
        return None
    path = schema_file or grammar_file
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        return grammar_spec(json_schema=text) if schema_file else grammar_spec(grammar=text)
    except GrammarError as e:
        raise UsageError(f"{path}: {e}") from None


def sampling_kwargs(params: SamplingParams) -> dict:
    return dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                top_k=params.top_k, top_p=params.top_p, seed=params.seed, grammar=params.grammar)


def stream_reply(sr, prompt, params: SamplingParams, *, chat: bool, out=None):
    """Stream one reply to `out` (stdout); returns (result, stats line). Ctrl-C aborts the
    request (the engine stays usable) and propagates."""
    out = out or sys.stdout
    first = last = None
    result = None
    chunks = sr.stream(prompt, chat=chat, **sampling_kwargs(params))
    with contextlib.closing(chunks):
        try:
            for i, chunk in enumerate(chunks):
                out.write(chunk.text)
                out.flush()
                if i == 0:
                    first = chunk
                last, result = chunk, chunk.result or result
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            raise
    if not result.text.endswith("\n"):
        out.write("\n")
    decode_tokens = result.stats.generated - len(first.token_ids)
    line = stats_line(result, first_token_s=first.elapsed, decode_s=last.elapsed - first.elapsed,
                      decode_tokens=decode_tokens)
    return result, line


def describe(sr) -> str:
    """The pool and how its requests run, in one line."""
    chain = sr.config.engine.chain
    if chain is not None:
        how = "chain " + ">".join(sr.pool.validate_chain(chain))
    else:
        how = "the router picks chain and k" if sr.router else "the pool's default chain"
    return f"pool (cheapest first): {' < '.join(sr.pool.order)}; target: {sr.pool.target}; {how}"


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    if sys.stdin.isatty():
        raise UsageError("give a prompt: --prompt TEXT, or pipe one on stdin "
                         "(`specrouter chat` for a conversation)")
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt read from stdin is empty")
    return [text]


def cmd_generate(args: argparse.Namespace) -> int:
    from specrouter.api import SpecRouter

    config, params = config_from_args(args)
    prompts = read_prompts(args)
    sr = SpecRouter.from_config(config, progress=True)
    print(describe(sr), file=sys.stderr)
    results, spec_time = [], 0.0
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"--- prompt {i}", file=sys.stderr)
        t0 = time.perf_counter()
        res, line = stream_reply(sr, prompt, params, chat=args.chat)
        spec_time += time.perf_counter() - t0
        results.append(res)
        print(line, file=sys.stderr)
    if args.verbose_stats:
        print(f"({STATS_LEGEND})", file=sys.stderr)
    if args.compare:
        _compare(sr, prompts, params, results, spec_time, chat=args.chat)
    return 0


def _compare(sr, prompts, params, results, spec_time: float, *, chat: bool) -> None:
    """Target-only on its own view of the pool (fresh drafters): neither system learns from the
    other's output."""
    from specrouter.api import SpecRouter

    baseline = SpecRouter(sr.pool.with_fresh_drafters(), None, sr.config)
    t0 = time.perf_counter()
    base = baseline.generate(prompts, chain=(sr.pool.target,), chat=chat, **sampling_kwargs(params))
    base_time = time.perf_counter() - t0
    same = all(a.token_ids == b.token_ids for a, b in zip(results, base))
    n_spec = sum(r.stats.generated for r in results)
    n_base = sum(r.stats.generated for r in base)
    print(f"speculative {n_spec / spec_time:.1f} tok/s vs target-only {n_base / base_time:.1f} "
          f"tok/s: {n_spec / spec_time / (n_base / base_time):.2f}x (prefill included)"
          + (f"; greedy output identical: {same}" if params.greedy else ""), file=sys.stderr)


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text, streamed (the embedded pool by default)",
                       description=__doc__)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable; default: stdin)")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the target's chat template")
    g.add_argument("--compare", action="store_true",
                   help="also run target-only decoding and print the speed-up")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="constrain the output to this JSON schema (docs/structured-output.md)")
    shape.add_argument("--grammar", metavar="FILE",
                       help="constrain the output to this Lark grammar (llguidance's dialect)")
    g.add_argument("--verbose-stats", action="store_true",
                   help="explain the statistics line after the replies")
    add_engine_arguments(g, k_help="draft length of a pinned --chain or of --static (default 4)")
    add_sampling_arguments(g, max_new_tokens=64)
    add_pool_arguments(g)
    g.set_defaults(func=cmd_generate)
