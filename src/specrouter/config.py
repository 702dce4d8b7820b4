"""Configuration dataclasses shared by the Python API, the CLI and the server: per-request
`SamplingParams`, the router's `RouterConfig`, the server's `ServerConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specrouter.errors import SamplingParamsError

MAX_DRAFT_LENGTH = 16  # k is searched in 1..MAX_DRAFT_LENGTH by the router


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    temperature == 0 means greedy decoding (the output is the target's argmax, token for token);
    top_k == 0 and top_p == 1.0 disable those filters. The same processed distribution is used
    at every level of a chain, which is what makes speculative sampling lossless.
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    max_new_tokens: int = 64  # generated tokens per request, stop tokens included
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (EOS is added by the pool)
    seed: int | None = None  # the sampling seed: the noise at position i is a function of (seed, i), so the same request and seed give the same output whatever chains run it
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)

    def __post_init__(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(f"invalid sampling parameters: {msg}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {p!r}")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise bad(f"max_new_tokens must be an integer >= 1, got {m!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {tok!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class RouterConfig:
    """Router settings (one object for the CLI, the server and the API)."""

    k_max: int = MAX_DRAFT_LENGTH  # draft lengths searched: 1..k_max
    max_levels: int = 4  # deepest chain considered
    switch_margin: float = 0.05  # switch at once when the best plan is predicted > 5% faster
    patience: int = 16  # ... or when it was predicted slower by > persist_margin this many decisions in a row
    persist_margin: float = 0.01  # the smallest gap that counts toward patience
    request_decay: float = 0.995  # per trial: a request's own acceptance counts forget (~200 trials)
    request_prior_strength: float = 8.0  # pseudo-trials of the global alpha in a request's estimate
    # a new request's prior for a model pair: the global alpha, or if higher this quantile of
    # the alphas finished requests reached on their own (request types differ: code and prose
    # accept a draft at different rates; the global mean is the prior of neither). None: global
    request_prior_quantile: float | None = 0.75
    request_history: int = 32  # finished requests remembered per pair and mode for that quantile
    request_hit_decay: float = 0.95  # per proposal: a request's own model-free hit counts forget (~20)
    probe_k: int = 8  # longest draft of a probe cycle
    probe_optimism: float = 1.5  # z of the Wilson upper bound that makes a stale pair worth a probe
    probe_recheck: int = 8  # row-cycles before looking again when no pair was worth a probe
    probe_fraction: float = 0.05  # at most this fraction of row-cycles are probes
    probe_time_fraction: float | None = 0.02  # and their cost at most this fraction of wall time
    overhead_alpha: float = 0.1  # EMA weight of one cycle's overhead (wall - forwards) and decide() time
    context_bucket: int = 32  # cost rows are cached per (b, L // context_bucket)
    prune_below: float = 0.02  # chains with an alpha (or a model-free hit rate) below this are not evaluated
    log_size: int = 10_000  # decision events kept

    def __post_init__(self) -> None:
        if not 1 <= self.k_max <= MAX_DRAFT_LENGTH:
            raise ValueError(f"k_max must be in 1..{MAX_DRAFT_LENGTH}, got {self.k_max}")
        if not 1 <= self.max_levels <= 4:
            raise ValueError(f"max_levels must be in 1..4, got {self.max_levels}")
        if self.switch_margin < 0 or self.patience < 1 or self.probe_k < 1:
            raise ValueError("switch_margin must be >= 0, patience and probe_k >= 1")


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
