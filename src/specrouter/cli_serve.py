"""`specrouter serve`: the OpenAI-compatible server over a pool (see specrouter.server)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .server import ServerConfig, create_app
    except ImportError as e:
        print(f"specrouter serve needs the serve extra: pip install 'specrouter[serve]' ({e})",
              file=sys.stderr)
        return 2
    from .pool import Pool

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("SPECROUTER_API_KEY") or None
    if not _is_loopback(args.host) and not api_key:
        print(f"specrouter serve: warning: listening on {args.host} without an API key "
              "(set --api-key or SPECROUTER_API_KEY)", file=sys.stderr)
    config = ServerConfig(
        served_model_name=args.served_model_name, api_key=api_key,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        chain=tuple(args.chain) if args.chain else None, k=args.k,
        model_timeout=args.model_timeout if args.model_timeout > 0 else None,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, seed=args.seed,
        adaptive=not args.static,
    )
    # trust_remote_code is never enabled by the server
    pool = Pool.load(list(args.models), target=args.target, backend=args.backend, dtype=args.dtype,
                     ngram=not args.no_ngram, trust_remote_code=False, progress=True)
    print(f"pool (cheapest first): {' < '.join(pool.order)}; target: {pool.target}",
          file=sys.stderr)
    app = create_app(pool, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=10)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def register(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, SSE, "
                                     "Prometheus metrics)")
    s.add_argument("--models", nargs="+", required=True,
                   help="checkpoint directories or .gguf files (\"ngram\" is added unless --no-ngram)")
    s.add_argument("--target", default=None, help="target name or path (default: the largest model)")
    s.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the target's name)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env SPECROUTER_API_KEY)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="rows in the running batch")
    s.add_argument("--max-model-len", type=int, default=2048,
                   help="positions per row: prompt + output + draft (capped by the models)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a row; beyond it: 429 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413)")
    s.add_argument("--static", action="store_true",
                   help="no router: requests run --chain (or the pool's default chain)")
    s.add_argument("--chain", nargs="+", default=None,
                   help="default chain, e.g. --chain ngram draft target (requests may pin theirs)")
    s.add_argument("--k", type=int, default=4, help="default draft length")
    s.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float64")
    s.add_argument("--backend", default="auto", help="auto | native | hf")
    s.add_argument("--no-ngram", action="store_true", help="do not add the n-gram drafter")
    s.add_argument("--model-timeout", type=float, default=30.0,
                   help="seconds a model forward may take before the model is taken out (0: none)")
    s.add_argument("--seed", type=int, default=None, help="seed of unseeded sampling requests' stream")
    s.add_argument("--log-level", default="info", help="debug | info | warning | error")
    s.set_defaults(func=cmd_serve)
