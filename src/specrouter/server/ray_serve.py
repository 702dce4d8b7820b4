"""Scale-out on Ray Serve: N replicas of the single-machine server behind Serve's HTTP proxy.

`specrouter serve --ray ...` calls `serve_on_ray`; tests and notebooks use `start_local_ray`,
`build_app` and `deploy` (see README, "Scale-out on Ray Serve", and docs/ray.md).

A replica is one Ray actor holding one whole pool: every model of every chain lives in that
process, on the device(s) Ray gave it, so a chain never crosses machines. Its ingress is the
FastAPI app of `create_app` (`@serve.ingress`, bound when the replica starts), so the API,
validation, streaming, errors and the engine thread are exactly `specrouter serve`'s: one
Engine per replica, continuous batching within the replica. Serve's proxy sends each HTTP
request to one replica (the less loaded of two), restarts replicas that die or fail their
health check, and scales their number between the autoscaling bounds.

Added to the single-machine app, per replica:
- `check_health` (Serve's hook, every `health_check_period_s`): fails when the engine thread
  died or the target model was taken out; Serve then replaces the replica.
- `GET /metrics` shows EVERY replica's metrics, labelled `replica` and `node`: replicas push a
  snapshot of their registry every `metrics_push_s` to a small `MetricsBoard` deployment (one
  replica, no CPU reserved) and the scraped replica adds its own fresh one. Also
  `specrouter_replicas` (replicas reporting) and `specrouter_replica_report_age_seconds`.
- an `x-specrouter-replica` response header: the replica that answered.

Ray is imported inside the functions: importing this module never needs it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specrouter.config import ServerConfig

logger = logging.getLogger("specrouter.server")

REPLICA_HEADER = "x-specrouter-replica"


@dataclass(frozen=True)
class PoolSpec:
    """What every replica loads: `Pool.load`'s arguments. Paths are read on the replica's node
    (every node needs the checkpoints at the same path, or a shared filesystem)."""

    paths: tuple[str, ...]  # checkpoint dirs / .gguf files / "ngram" / "default", as `--models`
    target: str | None = None  # target name or path; None: the largest model
    names: tuple[str, ...] | None = None  # pool names; None: folder names
    backend: str = "auto"  # auto | native | hf
    dtype: str = "auto"  # auto | float32 | bfloat16 | float64
    ngram: bool = True  # add the model-free n-gram drafter
    suffix: bool = True  # add the model-free suffix drafter
    device: str = "auto"  # where the replica's models run (Ray's CUDA_VISIBLE_DEVICES picks its GPUs)

    def load(self):
        from specrouter.config import PoolConfig
        from specrouter.models.pool import Pool

        # "default" (the embedded pool) is resolved on the replica's node
        return Pool.from_config(PoolConfig(models=self.paths, target=self.target, names=self.names,
                                           backend=self.backend, dtype=self.dtype,
                                           ngram=self.ngram, suffix=self.suffix, device=self.device,
                                           trust_remote_code=False))


@dataclass(frozen=True)
class RayServeConfig:
    """The Ray Serve side of a deployment (the `--ray-*` flags map onto these fields)."""

    num_replicas: int = 1  # fixed replica count; unused when `autoscaling` is set
    autoscaling: Mapping[str, Any] | None = None  # Serve's autoscaling_config, passed through
    num_cpus: float = 1.0  # CPUs reserved per replica (placement)
    num_gpus: float = 0.0  # GPUs reserved per replica (placement; Ray sets CUDA_VISIBLE_DEVICES)
    torch_threads: int | None = None  # torch threads per replica; None: max(1, int(num_cpus))
    max_ongoing_requests: int | None = None  # per replica; None: 2 * max_num_seqs
    max_queued_requests: int | None = None  # waiting in each proxy beyond that (503); None: max_queue
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    metrics_push_s: float = 5.0  # how often a replica pushes its metrics to the board
    app_name: str = "specrouter"  # the Serve application
    deployment_name: str = "SpecRouter"  # its replicas' deployment
    max_constructor_retry_count: int = 3  # a replica that cannot load the pool: give up after
    runtime_env: Mapping[str, Any] | None = field(default=None)  # Ray runtime_env of replicas

    def __post_init__(self):
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {self.num_replicas!r}")
        if self.autoscaling is not None and not isinstance(self.autoscaling, Mapping):
            raise ValueError(f"autoscaling must be a mapping (Serve's autoscaling_config), "
                             f"got {self.autoscaling!r}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("num_cpus and num_gpus must be >= 0")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads!r}")
        if not self.metrics_push_s > 0:
            raise ValueError(f"metrics_push_s must be > 0, got {self.metrics_push_s!r}")

    @property
    def threads(self) -> int:
        return self.torch_threads or max(1, int(self.num_cpus))


def replica_options(rc: RayServeConfig, sc: ServerConfig) -> dict:
    """`serve.deployment(...).options(**)` of the replicas (pure: no Ray needed)."""
    actor = {"num_cpus": rc.num_cpus, "num_gpus": rc.num_gpus}
    if rc.runtime_env:
        actor["runtime_env"] = dict(rc.runtime_env)
    opts = {
        "name": rc.deployment_name,
        "ray_actor_options": actor,
        # a replica takes a running batch plus one waiting; more waits in Serve's queue, where
        # the proxy can still send it to another replica and autoscaling sees it
        "max_ongoing_requests": rc.max_ongoing_requests or 2 * sc.max_num_seqs,
        "max_queued_requests": rc.max_queued_requests if rc.max_queued_requests is not None
        else sc.max_queue,
        "health_check_period_s": rc.health_check_period_s,
        "health_check_timeout_s": rc.health_check_timeout_s,
        "max_constructor_retry_count": rc.max_constructor_retry_count,
    }
    if rc.autoscaling is not None:
        opts["autoscaling_config"] = dict(rc.autoscaling)
    else:
        opts["num_replicas"] = rc.num_replicas
    return opts


# -- the replica --------------------------------------------------------------------------------
class SpecRouterReplica:
    """One Serve replica: the pool and the single-machine app (see the module docstring).
    Wrapped by `serve.ingress()` in `build_app`; the app is bound by `__serve_build_asgi_app__`."""

    def __init__(self, pool_spec: PoolSpec, server_config: ServerConfig, torch_threads: int,
                 board=None, metrics_push_s: float = 5.0):
        import ray
        import torch
        from ray import serve

        from specrouter.server.app import create_app
        from specrouter.server.threads import on_passing_thread

        torch.set_num_threads(torch_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        self._labels = {"replica": self.replica_id, "node": self.node}
        self._board, self._push_s, self._pusher = board, metrics_push_s, None
        # set-up on a thread that ends: the replica's only OpenMP team is its engine thread's
        app = on_passing_thread(lambda: create_app(pool_spec.load(), server_config))
        self._srv = app.state.server
        # /metrics: every replica's, not only this one's
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]
        app.add_api_route("/metrics", self._all_metrics, methods=["GET"], include_in_schema=False)
        app.add_middleware(_ReplicaHeader, replica=self.replica_id)
        self._specrouter_app = app  # not `app`: the ingress wrapper owns that name

    async def __serve_build_asgi_app__(self):
        if self._board is not None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())
        return self._specrouter_app

    async def check_health(self) -> None:
        """Serve's health hook: raise to have this replica replaced."""
        srv = self._srv
        if not srv.loop_engine.alive:
            raise RuntimeError(f"the engine thread is not running (error: {srv.loop_engine.error!r})")
        if srv.target_down:
            raise RuntimeError(f"the target model {srv.pool.target!r} was taken out of the pool")

    # metrics
    def _snapshot(self):
        from specrouter.server.replica_metrics import snapshot

        return snapshot(self._srv.metrics.registry, self._labels)

    async def _push(self, snap) -> None:
        await asyncio.wait_for(_awaited(self._board.report.remote(self.replica_id, self.node, snap)),
                               timeout=5)

    async def _push_loop(self) -> None:
        while True:
            try:
                await self._push(self._snapshot())
            except Exception as e:  # noqa: BLE001 - the board restarts; try again later
                logger.debug("metrics push failed: %r", e)
            await asyncio.sleep(self._push_s)

    async def _all_metrics(self):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        from specrouter.server.replica_metrics import render

        own = self._snapshot()
        if self._board is not None:
            try:
                await self._push(own)
                body = await asyncio.wait_for(_awaited(self._board.render.remote()), timeout=5)
                return Response(body, media_type=CONTENT_TYPE_LATEST)
            except Exception as e:  # noqa: BLE001 - the board is down: this replica's alone
                logger.warning("metrics board unreachable (%r): /metrics shows this replica only", e)
        return Response(render([own]), media_type=CONTENT_TYPE_LATEST)


async def _awaited(response):
    return await response


class _ReplicaHeader:
    """ASGI middleware: names the replica that answered in a response header."""

    def __init__(self, app, replica: str):
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_named)


class MetricsBoard:
    """The latest metrics snapshot of every replica (a deployment of one replica). A replica
    that has not reported for `ttl_s` (dead, replaced, scaled down) is dropped."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._snaps: dict[str, tuple[float, str, list]] = {}  # replica -> (time, node, families)

    async def report(self, replica: str, node: str, families: list) -> None:
        self._snaps[replica] = (time.monotonic(), node, families)

    async def render(self) -> bytes:
        from specrouter.server.replica_metrics import render

        now = time.monotonic()
        self._snaps = {r: s for r, s in self._snaps.items() if now - s[0] <= self.ttl_s}
        ages = [("specrouter_replica_report_age_seconds", {"replica": r, "node": n}, now - t)
                for r, (t, n, _) in sorted(self._snaps.items())]
        extra = [
            ("specrouter_replicas", "Replicas whose metrics are shown", "gauge", "",
             [("specrouter_replicas", {}, float(len(self._snaps)))]),
            ("specrouter_replica_report_age_seconds", "Seconds since a replica last reported its "
             "metrics", "gauge", "", ages),
        ]
        return render([s[2] for s in self._snaps.values()], extra)


# -- building, deploying, running ---------------------------------------------------------------
def build_app(pool_spec: PoolSpec, server_config: ServerConfig | None = None,
              ray_config: RayServeConfig | None = None):
    """The Serve application: the replicas (ingress) and their metrics board."""
    from ray import serve

    sc, rc = server_config or ServerConfig(), ray_config or RayServeConfig()
    board = serve.deployment(MetricsBoard).options(
        name=f"{rc.deployment_name}Metrics", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=256, logging_config={"enable_access_log": False},
    ).bind(max(10.0, 3 * rc.metrics_push_s))
    replicas = serve.deployment(serve.ingress()(SpecRouterReplica)).options(
        **replica_options(rc, sc))
    return replicas.bind(pool_spec, sc, rc.threads, board, rc.metrics_push_s)


def start_local_ray(*, num_cpus: int | None = None, num_gpus: int | None = None,
                    object_store_mb: int = 512, log_to_driver: bool = True) -> None:
    """Start a single-node Ray cluster on this machine. Its processes register and listen on
    127.0.0.1 only (Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` when it is imported: call
    this before anything imports ray). The object store is small: requests are small."""
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        logger.warning("ray was imported before start_local_ray: the local cluster may register "
                       "a non-loopback address")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single node, loopback
    import ray

    # "local": a new cluster even if RAY_ADDRESS or a `ray start` cluster is around
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             object_store_memory=object_store_mb << 20, log_to_driver=log_to_driver)


def deploy(pool_spec: PoolSpec, server_config: ServerConfig | None = None,
           ray_config: RayServeConfig | None = None, *, host: str = "127.0.0.1",
           port: int = 8000):
    """Deploy on the connected Ray cluster (`ray.init` first) and wait until every replica
    is running. Serve's proxy listens on host:port (if Serve already runs on the cluster, its
    HTTP options stay as they are). Returns the app's DeploymentHandle."""
    from ray import serve

    rc = ray_config or RayServeConfig()
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(pool_spec, server_config, rc), name=rc.app_name, route_prefix="/")


def serve_on_ray(pool_spec: PoolSpec, server_config: ServerConfig, ray_config: RayServeConfig,
                 *, address: str | None, host: str, port: int, detach: bool = False) -> int:
    """`specrouter serve --ray`: join the cluster at `address` (or start a local one), deploy,
    serve until SIGINT/SIGTERM, then delete the app (and stop the local cluster).
    `detach`: deploy on the existing cluster and return; the app keeps serving."""
    if detach and address is None:
        raise ValueError("--ray-detach needs --ray-address: a local cluster stops with this process")
    if address is None:
        start_local_ray()
    else:
        import ray

        ray.init(address=address)
    import ray
    from ray import serve

    rc = ray_config
    deployed = False
    try:
        deploy(pool_spec, server_config, rc, host=host, port=port)
        deployed = True
        n = (f"{rc.autoscaling.get('min_replicas', 1)}..{rc.autoscaling.get('max_replicas', 1)} "
             "replicas (autoscaling)") if rc.autoscaling else f"{rc.num_replicas} replica(s)"
        print(f"SpecRouter on Ray Serve: app {rc.app_name!r}, {n}, "
              f"http://{host}:{port}/v1" + ("" if detach else "; Ctrl-C stops it"), file=sys.stderr)
        if detach:
            return 0

        def _interrupt(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr)
        return 0
    finally:  # also on Ctrl-C while deploying
        try:
            if address is None:
                serve.shutdown()
            elif not (detach and deployed):
                try:
                    serve.delete(rc.app_name)
                except Exception as e:  # noqa: BLE001 - best effort on the way out
                    logger.warning("could not delete the app %r: %r", rc.app_name, e)
        finally:
            ray.shutdown()
