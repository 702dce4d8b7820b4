"""The state behind one app (`Service`): the guarded pool, the engine and its background loop,
the metrics; built from a `ServerConfig` (config.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from specrouter.config import ServerConfig, kv_cache_bytes
from specrouter.engine.engine import Engine
from specrouter.engine.faults import ForwardWatch, guard_runners
from specrouter.models.pool import Pool
from specrouter.models.tokenizer import text_encoder
from specrouter.server.async_engine import AsyncEngine
from specrouter.engine.contention import TeamGovernor
from specrouter.server.metrics import ServerMetrics
from specrouter.server.threads import release_omp_team_here

logger = logging.getLogger("specrouter.server")


class Service:
    """The state behind one app: engine, background loop, metrics."""

    def __init__(self, pool: Pool, config: ServerConfig):
        self.config = config
        if config.chain is not None:
            pool.validate_chain(config.chain)
        router = None
        if config.adaptive and len(pool.order) > 1:
            from specrouter.router.setup import build_router

            # profiled once per machine, then cached
            router = build_router(pool, progress=False, config=config.router)
        # the guarded runners are this server's own: the caller's pool object is left as it was;
        # their forwards run on the engine thread under the watchdog's deadline (faults.py)
        watch = ForwardWatch(config.model_timeout) if config.model_timeout is not None else None
        self.pool = dataclasses.replace(pool, runners=guard_runners(pool.runners, watch))
        max_ctx = min(r.max_context for r in self.pool.runners.values())
        max_len = min(config.max_model_len, max_ctx)
        if max_len < config.max_model_len:
            logger.warning("max_model_len %d is over the pool's context %d: using %d",
                           config.max_model_len, max_ctx, max_len)
        self.max_model_len = max_len
        self.engine = Engine(self.pool, max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                             router=router, prefix_cache=config.prefix_cache,
                             kv_cache_bytes=kv_cache_bytes(config.kv_cache_gb))
        self.metrics = ServerMetrics()
        self.metrics.learning_drafters = {n: d for n, d in self.pool.drafters.items() if hasattr(d, "memory")}
        self.metrics.prefix_cache = self.engine.prefix_cache
        self.engine.on_cycle = self.metrics.engine_cycle  # folded in when /metrics is scraped
        self.engine.on_model_failure = self.metrics.observe_failure
        # the engine thread runs every forward (the process's one OpenMP team: server/threads.py);
        # a hung forward hands its loop to a new thread (async_engine.py)
        # (only where every model's bits are independent of the thread count: Engine.thread_invariant)
        governor = (TeamGovernor(on_change=self.metrics.observe_governor)
                    if config.team_governor and self.engine.thread_invariant else None)
        self.loop_engine = AsyncEngine(self.engine, max_queue=config.max_queue, metrics=self.metrics,
                                       seed=config.seed, watch=watch, governor=governor)
        self.model_name = config.served_model_name or self.pool.target
        self.served_names = (self.model_name, *config.model_aliases)  # names /v1/models lists
        self.chat_template = config.chat_template  # None: the target tokenizer's
        self.encode = text_encoder(self.pool.tokenizer)  # (text, add_special_tokens) -> ids
        self.longest_token_bytes  # read the vocabulary here, not on the event loop at the first request (~45 ms)
        self.created = int(time.time())
        # the caller's thread loaded, profiled and reserved: its OpenMP team would make the
        # engine thread's barriers sleep for as long as the caller lives (server/threads.py)
        release_omp_team_here()

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """UTF-8 length of the longest vocabulary entry: no token covers more input bytes
        (byte-level entries spell one input byte per character; SentencePiece's '▁' is 3 bytes
        for a space). Bounds the bytes a prompt of n tokens can have."""
        return max((len(t.encode("utf-8")) for t in self.pool.tokenizer.get_vocab()), default=1)

    @functools.cached_property
    def token_text(self):
        """Token id -> its text in logprobs (server/logprobs.py), cached per server."""
        from specrouter.server.logprobs import TokenText

        return TokenText(self.pool.tokenizer)

    def close(self) -> None:
        self.loop_engine.stop()  # and its watchdog

    @property
    def target_down(self) -> bool:
        return self.pool.target in self.engine.failed_models or not self.loop_engine.alive

