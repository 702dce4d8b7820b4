"""`specrouter serve`: the OpenAI-compatible server over a pool (see specrouter.server); with
`--ray`, the same server as replicas of a Ray Serve application (specrouter.server.ray_serve)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import ipaddress
import json
import logging
import os
import sys

from specrouter.config import SUFFIX_SCOPES, ServerConfig
from specrouter.cli.options import (
    UsageError,
    add_engine_arguments,
    add_pool_arguments,
    check_pool,
    engine_config,
    pool_config,
)

SWITCH_INTERVAL_S = 0.0005  # the serving process's GIL switch interval (Python's default: 0.005)

logger = logging.getLogger("specrouter")


def config_from_args(args: argparse.Namespace):
    """The SpecRouterConfig of the flags (checked before any model loads)."""
    from specrouter.config import ServerConfig, SpecRouterConfig

    api_key = args.api_key or os.environ.get("SPECROUTER_API_KEY") or None
    names = list(args.served_model_name or [])
    chat_template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as e:
            raise UsageError(f"--chat-template: cannot read {args.chat_template!r}: {e}") from None
    try:
        server = ServerConfig(
            served_model_name=names[0] if names else None, model_aliases=tuple(names[1:]),
            allowed_origins=tuple(args.allowed_origins) if args.allowed_origins else None,
            chat_template=chat_template, api_key=api_key,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            model_timeout=args.model_timeout if args.model_timeout > 0 else None,
            max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, seed=args.seed,
            stream_interval=args.stream_interval, team_governor=not args.no_team_governor,
            metrics_auth=args.metrics_auth, suffix_scope=args.suffix_scope,
            allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return SpecRouterConfig(pool=pool_config(args), engine=engine_config(args, k_alone=True),
                            server=server)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from specrouter.server import create_app
        from specrouter.server.http11 import http_protocol
        from specrouter.server.threads import freeze_heap, on_passing_thread
    except ImportError as e:
        print(f"specrouter serve needs the serve extra: pip install 'specrouter[serve]' ({e})",
              file=sys.stderr)
        return 2
    if args.ray and importlib.util.find_spec("ray") is None:
        print("specrouter serve --ray needs the ray extra: pip install 'specrouter[ray]'",
              file=sys.stderr)
        return 2
    import torch

    from specrouter.models.pool import Pool

    config = config_from_args(args)
    if not _is_loopback(args.host) and not config.server.api_key:
        logger.warning("listening on %s without an API key (set --api-key or SPECROUTER_API_KEY)",
                       args.host)
    if args.ray:
        return _serve_ray(args, config)
    if config.pool.threads:
        torch.set_num_threads(config.pool.threads)

    def setup():
        preview = check_pool(config.pool, config.engine)
        # trust_remote_code is never enabled by the server
        pool = Pool.from_config(dataclasses.replace(config.pool, trust_remote_code=False),
                                progress=True, paths=list(preview.paths))
        print(f"pool (cheapest first): {' < '.join(pool.order)}; target: {pool.target}",
              file=sys.stderr)
        return create_app(pool, config.server)

    # all torch work of the set-up (checkpoint headers, weights, router profile) runs on a thread
    # that ends, so its OpenMP team goes with it; the main thread runs none (server/threads.py)
    app = on_passing_thread(setup)
    freeze_heap()  # no full collection walks the set-up's objects again (120 ms each: threads.py)
    # two threads take turns on the GIL for every step (the engine thread, the event loop): hand
    # it over within 0.5 ms instead of 5 (docs/serving-performance.md)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=10, http=http_protocol(), loop="auto")
    return 0


def ray_configs(args: argparse.Namespace, config=None):
    """(PoolSpec, RayServeConfig) of `specrouter serve --ray` (no Ray needed to build them)."""
    from specrouter.server.ray_serve import PoolSpec, RayServeConfig

    pool = config.pool if config is not None else pool_config(args)
    device = pool.device
    if args.ray_num_gpus > 0:  # the replica's engine runs on the GPUs Ray gives it
        if device == "cpu":
            raise ValueError("--ray-num-gpus reserves GPUs for each replica, but --device cpu keeps "
                             "the models off them: drop one of the two")
        device = "cuda" if device == "auto" else device
    pool_spec = PoolSpec(paths=pool.models, target=pool.target, backend=pool.backend,
                         dtype=pool.dtype, ngram=pool.ngram, suffix=pool.suffix, device=device)
    ray_config = RayServeConfig(
        num_replicas=args.ray_replicas, autoscaling=args.ray_autoscaling,
        num_cpus=args.ray_num_cpus, num_gpus=args.ray_num_gpus,
        torch_threads=args.ray_torch_threads, max_ongoing_requests=args.ray_max_ongoing_requests,
        app_name=args.ray_app_name)
    return pool_spec, ray_config


def _serve_ray(args: argparse.Namespace, config) -> int:
    from specrouter.server.ray_serve import serve_on_ray

    try:
        pool_spec, ray_config = ray_configs(args, config)
        return serve_on_ray(pool_spec, config.server, ray_config, address=args.ray_address,
                            host=args.host, port=args.port, detach=args.ray_detach)
    except (ValueError, RuntimeError) as e:  # bad flags; replicas that could not start
        print(f"specrouter serve --ray: {e}", file=sys.stderr)
        return 1


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. "
                                         "'{\"min_replicas\": 1, \"max_replicas\": 4}'")
    return value


def _stream_interval(text: str) -> int:
    """--stream-interval: steps (a positive integer), or "auto" / 0 (the server paces streams)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of steps or 'auto', got {text!r}")
    return n


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
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name clients use (default: the target's name); more names are "
                        "aliases requests may use too (responses carry the first)")
    s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the API cross-origin (CORS), e.g. "
                        "http://localhost:3000, or '*'; default: none (no CORS headers)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file replacing the target's")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env SPECROUTER_API_KEY)")
    s.add_argument("--metrics-auth", action="store_true",
                   help="with an API key: /metrics and /health require it too (default: open)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host names requests may name ('*' any, '*.example.com' a domain); "
                        "default: on a loopback address only loopback names (DNS rebinding), "
                        "any name on other addresses")
    s.add_argument("--max-num-seqs", type=int, default=8, help="rows in the running batch")
    s.add_argument("--max-model-len", type=int, default=2048,
                   help="positions per row: prompt + output (capped by the models; the draft "
                        "length shrinks near the end)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a row; beyond it: 429 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413)")
    s.add_argument("--stream-interval", type=_stream_interval, default=ServerConfig.stream_interval,
                   metavar="STEPS|auto",
                   help="while other rows run, a streamed row's SSE chunk carries the tokens of this many "
                        "engine steps (first and last tokens are never held, nor a lone row's with a fixed N; rows with stop "
                        "strings read every step); default auto (also 0): the fewest steps that keep the "
                        "engine's hand-offs to the HTTP side within 1.5%% of its time, a chunk at least "
                        "every 100 ms (a lone row's too, at least every 50 ms)")
    s.add_argument("--no-team-governor", action="store_true",
                   help="keep the engine's torch threads at their count even while another process takes "
                        "one of their cores (default: fewer threads then, back once the cores are idle)")
    s.add_argument("--suffix-scope", choices=SUFFIX_SCOPES, default="shared",
                   help="whose earlier requests the suffix drafter drafts from: shared (all), or "
                        "api-key (only requests with the same Authorization header value; "
                        "for deployments that must not share them across users)")
    s.add_argument("--model-timeout", type=float, default=30.0,
                   help="seconds a model forward may take before the model is taken out (0: none)")
    s.add_argument("--seed", type=int, default=None, help="seed of unseeded sampling requests' stream")
    s.add_argument("--log-level", default="info", help="debug | info | warning | error")
    add_engine_arguments(s, k_help="draft length of requests that pin a chain without "
                                   "specrouter_k, and of --chain / --static (default 4)", trees=False)
    add_pool_arguments(s, flags=("models", "target", "dtype", "backend", "no_ngram", "no_suffix", "threads",
                                 "profile_path", "device"))
    r = s.add_argument_group("scale-out on Ray Serve (needs the ray extra; see docs/ray.md)")
    r.add_argument("--ray", action="store_true",
                   help="deploy as a Ray Serve application: replicas each holding the pool, "
                        "behind Serve's HTTP proxy on --host/--port")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto', or HEAD_IP:6379); default: start a local "
                        "one-node cluster on loopback")
    r.add_argument("--ray-replicas", type=int, default=1, help="replicas (without autoscaling)")
    r.add_argument("--ray-autoscaling", type=_json_object, default=None, metavar="JSON",
                   help="Serve's autoscaling_config, passed through, e.g. '{\"min_replicas\": 1, "
                        "\"max_replicas\": 4, \"target_ongoing_requests\": 8}' (replaces "
                        "--ray-replicas)")
    r.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    r.add_argument("--ray-num-gpus", type=float, default=0.0, help="GPUs reserved per replica")
    r.add_argument("--ray-torch-threads", type=int, default=None,
                   help="torch threads per replica (default: --ray-num-cpus, at least 1)")
    r.add_argument("--ray-max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once (default: 2 x --max-num-seqs); "
                        "more wait in Serve's queue (--max-queue per proxy, then 503)")
    r.add_argument("--ray-app-name", default="specrouter", help="Serve application name")
    r.add_argument("--ray-detach", action="store_true",
                   help="with --ray-address: deploy and exit, the app keeps serving "
                        "(stop it with `serve shutdown` or `serve delete`)")
    s.set_defaults(func=cmd_serve)
