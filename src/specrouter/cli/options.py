"""The flags shared by the commands, defined once: the pool (`--models`, `--target`, `--dtype`,
`--backend`, `--no-ngram`, `--no-suffix`, `--threads`, `--profile-path`, `--device`), the engine (`--chain`, `--k`,
`--static`) and sampling (`--max-new-tokens`, `--temperature`, `--top-k`, `--top-p`, `--seed`),
and their checks, which run before any model loads. Each maps onto a field of
`specrouter.config` (PoolConfig, EngineConfig, SamplingParams)."""

from __future__ import annotations

import argparse
import logging

from specrouter.config import (
    BACKENDS,
    DEFAULT_POOL,
    MAX_DRAFT_LENGTH,
    EngineConfig,
    PoolConfig,
    SamplingParams,
)
from specrouter.errors import ChainError, SamplingParamsError

logger = logging.getLogger("specrouter")

POOL_FLAGS = ("models", "target", "dtype", "backend", "no_ngram", "no_suffix", "threads",
              "profile_path", "device")


class UsageError(ValueError):
    """Flags that contradict each other or do nothing (exit status 2, before any model loads)."""


def _draft_length(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= k <= MAX_DRAFT_LENGTH:
        raise argparse.ArgumentTypeError(f"the draft length must be in 1..{MAX_DRAFT_LENGTH}, got {k}")
    return k


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"threads must be >= 1, got {n}")
    return n


def add_pool_arguments(p: argparse.ArgumentParser, flags: tuple[str, ...] = POOL_FLAGS) -> None:
    """The pool flags (all, or the subset `flags` of POOL_FLAGS a command supports)."""
    g = p.add_argument_group("pool")
    if "models" in flags:
        g.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                       help=f"checkpoint directories, .gguf files, draft-head folders (distill "
                            f"--head: head.safetensors + head_config.json), or {DEFAULT_POOL!r}: "
                            "the embedded pool (n-gram, the shipped 11M draft, "
                            "SmolLM2-135M-Instruct); the default. The n-gram drafter is added "
                            "unless --no-ngram")
    if "target" in flags:
        g.add_argument("--target", default=None,
                       help="target model: a pool name or path (default: the model with the most "
                            "parameters)")
    if "dtype" in flags:
        g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float64"),
                       help="weights and compute of every model; greedy output equals the target's "
                            "plain decoding at that precision exactly (default auto: bfloat16 on "
                            "the native CPU kernels, float32 elsewhere)")
    if "backend" in flags:
        g.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="auto: the native runner for Llama-family models, transformers for "
                            "others (default)")
    if "no_ngram" in flags:
        g.add_argument("--no-ngram", action="store_true",
                       help="leave the model-free n-gram drafter out of the pool")
    if "no_suffix" in flags:
        g.add_argument("--no-suffix", action="store_true",
                       help="leave the model-free suffix drafter (learns from earlier requests) "
                            "out of the pool")
    if "threads" in flags:
        g.add_argument("--threads", type=_threads, default=None,
                       help="torch threads (default: torch's, usually the number of cores)")
    if "profile_path" in flags:
        g.add_argument("--profile-path", default=None,
                       help="this machine's cost profile of the models (default: in the cache dir)")
    if "device" in flags:
        g.add_argument("--device", default=None, metavar="DEVICE",
                       help="where the models run: auto (the first CUDA GPU when torch sees one, "
                            "else the CPU; the default), cpu, cuda, cuda:N")


def pool_config(args: argparse.Namespace) -> PoolConfig:
    """The PoolConfig of the pool flags (the ones a command does not define keep their defaults)."""
    over = {}
    for name in ("target", "dtype", "backend", "threads", "profile_path", "device"):
        if getattr(args, name, None) is not None:
            over[name] = getattr(args, name)
    if getattr(args, "models", None):
        over["models"] = tuple(args.models)
    if getattr(args, "no_ngram", False):
        over["ngram"] = False
    if getattr(args, "no_suffix", False):
        over["suffix"] = False
    try:
        return PoolConfig(**over)
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_engine_arguments(p: argparse.ArgumentParser, *, k_help: str, trees: bool = True) -> None:
    """--chain, --k, --static, and (`trees`) --trees / --no-trees (not for serve: the server's
    batches keep chains)."""
    g = p.add_argument_group("chain")
    g.add_argument("--chain", nargs="+", default=None, metavar="MODEL",
                   help="pin a static chain, cheapest first, ending at the target: pool names or "
                        "the roles ngram, draft (the smallest draft), target; e.g. --chain ngram "
                        "draft target (default: the router picks chain and draft length per "
                        "request every cycle)")
    g.add_argument("--k", type=_draft_length, default=None, help=k_help)
    g.add_argument("--static", action="store_true",
                   help="no router: the pool's default chain (its smallest draft, then the target)")
    if trees:
        g.add_argument("--trees", action="store_true",
                       help="in a single stream the router may verify a token tree instead of a chain (a "
                            "model draft's alternatives, or every continuation the suffix drafter saw) "
                            "where its measured costs predict a gain, in sampled rows too (default: "
                            "greedy rows only: docs/trees.md)")
        g.add_argument("--no-trees", action="store_true", help="chains only (overrides --trees)")
    c = p.add_argument_group("prefix cache")
    c.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt (default: a request that starts like an earlier "
                        "one reuses its KV in every model, bit for bit)")
    c.add_argument("--kv-cache-gb", type=float, default=None,
                   help="memory the prefix cache may keep parked (default: a tenth of RAM, at most 4)")


def engine_config(args: argparse.Namespace, *, k_alone: bool = False) -> EngineConfig:
    """EngineConfig of --chain/--k/--static. `k_alone`: --k means something without --chain
    (serve: the draft length of requests that pin a chain); otherwise --k without --chain or
    --static is an error (the router picks k)."""
    if args.k is not None and args.chain is None and not args.static and not k_alone:
        raise UsageError("--k is the draft length of a pinned --chain (or of --static); without "
                         "them the router picks k every cycle: drop --k or add --chain")
    if args.static and args.chain is not None:
        logger.warning("--static has no effect with --chain (a pinned chain never uses the router)")
    try:
        return EngineConfig(chain=tuple(args.chain) if args.chain else None,
                            k=args.k if args.k is not None else 4,
                            adaptive=not args.static,
                            prefix_cache=not getattr(args, "no_prefix_cache", False),
                            kv_cache_gb=getattr(args, "kv_cache_gb", None),
                            trees=("off" if getattr(args, "no_trees", False) else
                                   "on" if getattr(args, "trees", False) else "greedy"))
    except (ChainError, ValueError) as e:
        raise UsageError(str(e)) from None


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens to generate per reply (default {max_new_tokens})")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default): the target's own greedy output, token for token")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (t > 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling (t > 0)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling stream (t > 0)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams of the sampling flags; flags that do nothing under greedy decoding are
    warned about."""
    if args.temperature == 0:
        idle = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                if v is not None]
        if idle:
            logger.warning("%s %s no effect with greedy decoding (--temperature 0)",
                           ", ".join(idle), "has" if len(idle) == 1 else "have")
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k or 0,
                              top_p=1.0 if args.top_p is None else args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    except SamplingParamsError as e:
        raise UsageError(str(e)) from None


def check_pool(pool: PoolConfig, engine: EngineConfig):
    """The pool's paths, names, target and a pinned chain, from checkpoint headers (no weights
    load); returns the PoolPreview (its `paths` are the expanded entries)."""
    from specrouter.models.pool import preview_pool

    preview = preview_pool(pool, progress=True)
    if engine.chain is not None:
        preview.validate_chain(engine.chain)
    return preview
