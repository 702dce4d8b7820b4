"""The state behind one app (`Service`): the guarded pool, the engine and its background loop,
the metrics; and the settings it is built from (`ServerConfig`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from specrouter.engine.engine import Engine
from specrouter.engine.faults import GuardedRunner, guard_runners
from specrouter.models.pool import Pool
from specrouter.server.async_engine import AsyncEngine
from specrouter.server.metrics import ServerMetrics

logger = logging.getLogger("specrouter.server")


@dataclass(frozen=True)
class ServerConfig:
    """Everything `specrouter serve` configures (its flags map onto these fields)."""

    served_model_name: str | None = None  # name in /v1/models and responses; None: the target's
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on /v1/* when set
    max_num_seqs: int = 8  # rows in the running batch (cache slots per model)
    max_model_len: int = 2048  # positions per row (prompt + output + draft); capped by the models
    chain: tuple[str, ...] | None = None  # default chain; None: the engine's (router / pool default)
    k: int = 4  # default draft length
    model_timeout: float | None = 30.0  # seconds a model forward may take before it is taken out
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    max_body_bytes: int = 1 << 20  # request body limit (413 beyond)
    retry_after_s: int = 1  # Retry-After of a 429
    seed: int | None = None  # seed of the engine's random stream (unseeded sampling requests)
    adaptive: bool = True  # the router picks chain and k per request (unless a chain is pinned)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "k", "max_queue", "max_body_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.model_timeout is not None and not self.model_timeout > 0:
            raise ValueError(f"model_timeout must be > 0 seconds or None, got {self.model_timeout!r}")


class Service:
    """The state behind one app: engine, background loop, metrics."""

    def __init__(self, pool: Pool, config: ServerConfig):
        self.config = config
        if config.chain is not None:
            pool.validate_chain(config.chain)
        router = None
        if config.adaptive and len(pool.order) > 1:
            from specrouter.router.setup import build_router

            router = build_router(pool, progress=False)  # profiled once per machine, then cached
        # the guarded runners are this server's own: the caller's pool object is left as it was
        self.pool = dataclasses.replace(pool, runners=guard_runners(pool.runners, config.model_timeout))
        max_ctx = min(r.max_context for r in self.pool.runners.values())
        max_len = min(config.max_model_len, max_ctx)
        if max_len < config.max_model_len:
            logger.warning("max_model_len %d is over the pool's context %d: using %d",
                           config.max_model_len, max_ctx, max_len)
        self.max_model_len = max_len
        self.engine = Engine(self.pool, max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                             router=router)
        self.metrics = ServerMetrics()
        self.engine.on_cycle = self.metrics.observe_cycle
        self.engine.on_model_failure = self.metrics.observe_failure
        self.loop_engine = AsyncEngine(self.engine, max_queue=config.max_queue,
                                       metrics=self.metrics, seed=config.seed)
        self.model_name = config.served_model_name or self.pool.target
        self.created = int(time.time())

    def close(self) -> None:
        self.loop_engine.stop()
        for r in self.pool.runners.values():
            if isinstance(r, GuardedRunner):
                r.close()

    @property
    def target_down(self) -> bool:
        return self.pool.target in self.engine.failed_models or not self.loop_engine.alive

