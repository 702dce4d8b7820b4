"""The decision cache (issue 14): decide when the batch or the evidence changes, not per row per
cycle. A decision (steps 1-2 of policy.py: the PlanTable's argmin and hysteresis) is a pure
function of the row's shape and of the evidence it reads, so the router reuses a row's PlanTable
while both are unchanged.

- **Published evidence.** decide() never reads the live estimates, which move a little every
  cycle, but a snapshot of them (`Published`, one per router, and `RequestEvidence`, one per
  request) that is republished, with a new version, when the live evidence moved materially:
  - a pair's acceptance prior (`Router.request_prior`: the global alpha, or the finished
    requests' quantile above it) or a request's own alpha moved by more than
    `decision_tolerance` (0.05) since it was published, or a model-free drafter's hit rate
    (global or a request's) by more than `decision_hit_tolerance` (0.1). Both are about the
    estimators' own noise (an alpha over a ~200-trial window, a hit rate over ~20 proposals):
    a smaller move is as likely noise as news, and republishing on it would make every
    decision a miss;
  - the profile's step detector fired (a slowdown or a recovery), or a time moved by more than
    `decision_time_tolerance` (5%) of the target's one-token step: a model's predicted
    one-token step (its speed factor, its refined shape) or a per-cycle overhead (the
    engine's, plain or speculative, or the router's own decide() time). Times are measured
    against the target's step because plans are: a drafter 20x cheaper than the target may
    drift 20x more (relatively) before it matters as much;
  - a model was marked failed (`Router.mark_failed`): at once;
  - and at least every `decision_refresh` (128) observed steps, for what no rule watches (the
    profile's slow shape refinements).
  The cost rows T_M(b, ., L) are cached per published version too. A tolerance of 0 republishes
  on every change: the published evidence is then the live one.
- **The key.** `decision_key`: the row's batch size b, its context bucket (L // context_bucket,
  the cost rows' resolution), the mode, its k cap (remaining tokens), the request's current
  chain (always evaluated, never pruned), and the router's and the request's evidence versions.
  The same key means the same inputs, so the cached PlanTable and its argmin (step 1, the
  expensive part) are exactly those decide() would compute afresh (`decision_cache=False`).
  Hysteresis (step 2) is a few comparisons on that table and runs at every call, so its
  counters and switches are exactly those of an uncached router.
- **Exploration is not cached.** Probing (step 3) runs after the lookup on its own schedule,
  hit or miss, exactly as without the cache; shadow scoring is the engine's and unaffected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specrouter.config import RouterConfig
from specrouter.router.cost_model import PlanTable
from specrouter.records.routing import Chain, Pair


@dataclass(frozen=True)
class Published:
    """The router-wide evidence decide() reads, as of its last material change."""

    version: int  # increases with every publication
    priors: Mapping[tuple[Pair, str], float]  # (pair, mode) -> a request's prior alpha (request_prior)
    hits: Mapping[str, float]  # model-free drafter -> global hit rate
    times: Mapping[str, float]  # per-cycle seconds: "plain" and "spec" overheads, "router" (one decide)
    steps: Mapping[str, float]  # model -> seconds of its one-token step (b = 1), as the profile predicts
    jumps: Mapping[str, int]  # model -> times the profile's step detector fired
    failed: frozenset[str]  # models out of service
    scale: float  # seconds of the target's one-token step (b = 1): the yardstick of time tolerances
    observed: int  # observed steps when published


@dataclass(frozen=True)
class RequestEvidence:
    """A request's own published estimates (its alphas shrunk toward the priors, its hit rates)."""

    stamp: tuple[int, int, str]  # (router version, request version, mode) it was computed at
    alphas: Mapping[Pair, float]  # rounded to alpha_decimals
    hits: Mapping[str, float]  # model-free drafter -> hit rate


@dataclass(frozen=True)
class CachedPlans:
    """Step 1 of a decision (policy.py `Router._plans`): the row's PlanTable and its argmin."""

    key: tuple  # decision_key
    table: PlanTable  # every chain x k, all overheads (plan_batch weighs alternatives with it too)
    costs: Mapping[str, object]  # the cost rows it was computed from
    best: tuple[Chain, int]  # its argmin
    t_best: float
    t_plain: float
    floors: dict = field(default_factory=dict, compare=False)  # plan -> its confidence floor (memo)


@dataclass
class CacheStats:
    """Decision cache lookups (decisions that could be cached: k cap >= 1, more than one chain)."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def crossed(value: float, published: float, tolerance: float, threshold: float | None = None) -> bool:
    """`value` moved by more than `tolerance` from `published`, or crossed `threshold` (the
    router's pruning line: a drafter or pair that falls below it must be pruned at once)."""
    if abs(value - published) > tolerance:
        return True
    return threshold is not None and (value < threshold) != (published < threshold)


def moved(live: Mapping, published: Mapping, tolerance: float, threshold: float | None = None) -> bool:
    """Some value moved by more than `tolerance` (absolute) or crossed `threshold`, or appeared
    or disappeared."""
    if live.keys() != published.keys():
        return True
    return any(crossed(v, published[k], tolerance, threshold) for k, v in live.items())


def material_change(live: Published, published: Published, config: RouterConfig) -> bool:
    """Does `live` differ from `published` enough to republish (module docstring)?"""
    seconds = config.decision_time_tolerance * published.scale
    return (live.failed != published.failed or live.jumps != published.jumps
            or live.observed - published.observed >= config.decision_refresh
            or moved(live.priors, published.priors, config.decision_tolerance, config.prune_below)
            or moved(live.hits, published.hits, config.decision_hit_tolerance, config.prune_below)
            or moved(live.steps, published.steps, seconds) or moved(live.times, published.times, seconds))


def decision_key(batch_size: int, context_bucket: int, mode: str, k_cap: int, chain: Chain | None,
                 version: int, request_version: int) -> tuple:
    """What step 1 depends on (module docstring): equal keys, equal PlanTables."""
    return (batch_size, context_bucket, mode, k_cap, chain, version, request_version)
