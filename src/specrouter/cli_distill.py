"""`specrouter distill`: train a small draft of a target by knowledge distillation (CPU,
resumable, progress bar, held-out agreement report). Flags mirror `specrouter.distill.distill`."""

from __future__ import annotations

import argparse
import json


def cmd_distill(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .distill import distill
    from .pool import resolve_checkpoint

    target = args.target
    if target == "default":
        from .gguf_convert import default_target_dir

        target = default_target_dir()
    report = distill(
        resolve_checkpoint(target), args.out_dir, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, corpus_tokens=args.corpus_tokens,
        seed=args.seed, resume=not args.no_resume, threads=args.threads,
    )
    print(json.dumps(asdict(report), indent=2, default=str))
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
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-tokens", type=int, default=300_000, help="distillation corpus size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    p.set_defaults(func=cmd_distill)
