"""`specrouter distill`: train a small draft of a target by knowledge distillation (CPU,
resumable, progress bar, held-out agreement report). The flags build a
`specrouter.distill.train.DistillConfig` (its fields document them)."""

from __future__ import annotations

import argparse
import json


def cmd_distill(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specrouter.distill.train import run_distill
    from specrouter.models.pool import resolve_checkpoint

    target = args.target
    if target == "default":
        from specrouter.models.gguf_convert import default_target_dir

        target = default_target_dir()
    if args.head:
        from specrouter.heads.train import run_head_distill

        report = run_head_distill(head_config_from_args(resolve_checkpoint(target), args))
        print(json.dumps(asdict(report), indent=2, default=str))
        return 0
    if args.eval_only:
        return _eval_only(resolve_checkpoint(target), args)
    report = run_distill(config_from_args(resolve_checkpoint(target), args))
    print(json.dumps(asdict(report), indent=2, default=str))
    return 0


def config_from_args(target, args: argparse.Namespace):
    """The DistillConfig of the flags (validated: a bad value is a SpecRouterError)."""
    from specrouter.distill.train import DistillConfig

    return DistillConfig(
        target=target, out_dir=args.out_dir, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, batch_size=args.batch_size,
        seq_len=args.seq_len, **_given(args, "steps", "lr", "corpus_tokens", "generated_fraction"),
        seed=args.seed, resume=not args.no_resume,
        threads=args.threads, corpus_dir=args.corpus_dir,
        extra_corpus_dirs=tuple(args.extra_corpus_dir or ()), init_from=args.init_from,
        greedy_eval_tokens=args.greedy_eval_tokens, draft_vocab_size=args.draft_vocab_size,
        **_given(args, "prompts"),
    )


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The flags among `names` given on the command line (their defaults differ per mode)."""
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def head_config_from_args(target, args: argparse.Namespace):
    """The HeadDistillConfig of the flags (`--head`)."""
    from specrouter.heads.train import HeadDistillConfig

    compare = args.compare_draft or None
    if compare == "shipped":
        from specrouter.models.default_pool import shipped_drafts

        drafts = shipped_drafts()
        compare = drafts[0] if drafts else None
    return HeadDistillConfig(
        target=target, out_dir=args.out_dir, vocab_size=args.head_vocab_size, batch_size=args.batch_size,
        seq_len=args.seq_len, unroll=args.unroll, noise=args.noise, seed=args.seed,
        resume=not args.no_resume, threads=args.threads, corpus_dir=args.corpus_dir,
        features_dir=args.features_dir, eval_depth=args.eval_depth, compare_draft=compare,
        **_given(args, "steps", "lr", "corpus_tokens", "prompts"),
    )


def _eval_only(target, args: argparse.Namespace) -> int:
    """Held-out greedy agreement of the draft in --out-dir with the target (draft_eval.py)."""
    from dataclasses import asdict

    import torch

    from specrouter.distill.evaluate import greedy_agreement
    from specrouter.distill.train import load_target
    from specrouter.errors import CheckpointError

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    teacher, tokenizer = load_target(target)
    try:  # the draft shares the target's tokenizer: its folder needs no tokenizer files
        draft = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--out-dir {args.out_dir} is not a draft checkpoint: {e}") from e
    report = greedy_agreement(draft, teacher, tokenizer, max_new_tokens=args.greedy_eval_tokens)
    print(json.dumps(asdict(report), indent=2))
    return 0


def register(sub) -> None:
    p = sub.add_parser("distill", help="distil a small draft model from a target (CPU, resumable)")
    p.add_argument("--target", default="default",
                   help="target checkpoint dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out-dir", required=True, help="where checkpoints, recipe.json, report.json go")
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3000; --head 600)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3; --head 1e-3)")
    p.add_argument("--corpus-tokens", type=int, default=None,
                   help="distillation corpus size (default 300000; --head 150000)")
    p.add_argument("--generated-fraction", type=float, default=None,
                   help="share of the corpus the target writes itself, the rest stdlib and docs "
                        "(default 0.6; --head writes all of its corpus on the native runner)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    p.add_argument("--corpus-dir", default=None, help="corpus folder (default: OUT_DIR/corpus)")
    p.add_argument("--extra-corpus-dir", action="append", metavar="DIR",
                   help="a finished corpus whose rows are added (repeatable)")
    p.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from this draft checkpoint (same shape) instead of a fresh init")
    p.add_argument("--greedy-eval-tokens", type=int, default=96,
                   help="tokens per prompt of the end-to-end greedy-agreement evaluation (0: skip)")
    p.add_argument("--draft-vocab-size", type=int, default=16384,
                   help="the draft proposes only the N most frequent corpus tokens (0: all)")
    p.add_argument("--prompts", choices=("v1", "v2"), default=None,
                   help="the corpus's prompt set: v2 (system prompts, multi-turn chats, many kinds of "
                        "ask; the default for a draft) or v1 (one-turn templated chats: rebuilds the "
                        "drafts made before v2; the default with --head, as the shipped head was built)")
    p.add_argument("--eval-only", action="store_true",
                   help="only evaluate the draft in --out-dir: held-out greedy agreement")
    h = p.add_argument_group("draft head (--head): an EAGLE-style head on the target's features")
    h.add_argument("--head", action="store_true",
                   help="train a feature-level draft head (specrouter.heads) instead of a draft model")
    h.add_argument("--head-vocab-size", type=int, default=8192,
                   help="the head's reduced vocabulary: the N most frequent corpus tokens")
    h.add_argument("--unroll", type=int, default=2,
                   help="draft depths trained per step (the head reads its own predicted features)")
    h.add_argument("--noise", type=float, default=0.0, help="std of noise on the target features in training")
    h.add_argument("--features-dir", default=None, help="cache of the target's features (default OUT_DIR/features)")
    h.add_argument("--eval-depth", type=int, default=8, help="draft depths of the held-out evaluation")
    h.add_argument("--compare-draft", default="shipped", metavar="DRAFT",
                   help="a draft checkpoint evaluated alike ('shipped': the package's draft; '' none)")
    p.set_defaults(func=cmd_distill)
