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
  the cost rows' resolution), the mode, the request's current chain (always evaluated, never
  pruned), and the router's and the request's evidence versions. The same key means the same
  inputs, so the cached PlanTable and its argmin (step 1, the expensive part) are exactly those
  decide() would compute afresh (tests/test_decision_cache.py's uncached reference). The table always spans k = 1..k_max
  and a row's k cap (its remaining tokens) only limits the argmin (`CachedPlans.best`): the cap
  shrinking near a request's end was a quarter of the misses on the mixed stream.
  Hysteresis (step 2) is a few comparisons on that table and runs at every call, so its
  counters and switches are exactly those of an uncached router.
- **A margin of uncertainty** (`decision_margin`, `RouterConfig.decision_margin_sampling` /
  `_greedy`): a request's alphas and hit rates are published less z standard errors of its own
  estimate (its decayed trials plus its prior's pseudo-trials): a plan is chosen where its
  estimate is high, and at t=0.7 that estimate was often high by chance. Probes add their own
  optimism on top (router/probing.py).
- **Exploration is not cached.** Probing (step 3) runs after the lookup on its own schedule,
  hit or miss, exactly as without the cache; shadow scoring is the engine's and unaffected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specrouter.config import RouterConfig
from specrouter.router.cost_model import ModelFreeDraft, PlanTable
from specrouter.router.host_time import PlainCharge
from specrouter.router.similarity import GREEDY, SAMPLING
from specrouter.records.routing import Chain, Pair


@dataclass(frozen=True)
class Published:
    """The router-wide evidence decide() reads, as of its last material change."""

    version: int  # increases with every publication
    priors: Mapping[tuple[Pair, str], float]  # (pair, mode) -> a request's prior alpha (request_prior); (triple, mode) -> global confirmed alpha
    hits: Mapping[str, float]  # model-free drafter -> global hit rate
    times: Mapping[str, float]  # host seconds: "plain", "spec" (per cycle), "draft_step" (per draft step), "processor" (per row-forward of a row with processors), "router" (one decide)
    steps: Mapping[str, float]  # model -> seconds of its one-token step (b = 1), as the profile predicts
    jumps: Mapping[str, int]  # model -> times the profile's step detector fired
    failed: frozenset[str]  # models out of service
    scale: float  # seconds of the target's one-token step (b = 1): the yardstick of time tolerances
    observed: int  # observed steps when published


@dataclass(frozen=True)
class RequestEvidence:
    """A request's own published estimates (its alphas shrunk toward the priors, its hit rates)."""

    stamp: tuple[int, int, str]  # (router version, request version, mode) it was computed at
    alphas: Mapping[Pair, float]  # rounded to alpha_decimals; pairs and triples (policy.Router.alpha)
    hits: Mapping[str, float]  # model-free drafter -> hit rate


@dataclass(frozen=True)
class CachedPlans:
    """Step 1 of a decision (policy.py `Router._plans`): the row's PlanTable over every k up to
    `RouterConfig.k_max`, and its argmin per k cap (`best`)."""

    key: tuple  # decision_key
    table: PlanTable  # every chain x k, all overheads (plan_batch weighs alternatives with it too)
    costs: Mapping[str, object]  # the cost rows it was computed from
    t_plain: float
    # host seconds per cycle charged where plain decoding is weighed against speculation
    charge: PlainCharge = field(default_factory=PlainCharge)
    alphas: Mapping = field(default_factory=dict)  # the estimates it was computed from (`Router.inputs`) ...
    overhead: float = 0.0  # ... and the router's seconds per speculative cycle (the prober reads them too)
    floors: dict = field(default_factory=dict, compare=False)  # plan -> its confidence floor (memo)
    bests: dict = field(default_factory=dict, compare=False)  # k cap -> (plan, T_eff): argmin (memo)
    # (C, K) T_eff with each kind's charge (`PlainCharge.t_eff`; the table's own without one)
    charged: np.ndarray = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "charged", self.charge.t_eff(self.table) if self.charge.nonzero else self.table.t_eff)

    def best(self, k_cap: int) -> tuple[tuple[Chain, int], float]:
        """(plan, T_eff) of least T_eff with k <= k_cap: first minimum, earlier chain, smaller k
        (column j of the table is k = j + 1 whatever the cap, so one table serves every cap),
        plain decoding against the best speculative plan with their charge (`PlainCharge.best`)."""
        hit = self.bests.get(k_cap)
        if hit is None:
            i, j = self.charge.best(self.table, k_cap, self.charged)
            chain = self.table.chains[i]
            hit = self.bests[k_cap] = ((chain, 0 if len(chain) == 1 else j + 1), float(self.table.t_eff[i, j]))
        return hit


KEY_FIELDS = ("batch", "context", "mode", "chain", "version", "request_version", "certain")  # decision_key's


@dataclass
class CacheStats:
    """Decision cache lookups (decisions that could be cached: k cap >= 1, more than one chain),
    and per key field, the misses where it changed (a request's first decision: "first")."""

    hits: int = 0
    misses: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def miss(self, old_key: tuple | None, key: tuple) -> None:
        self.misses += 1
        changed = ["first"] if old_key is None else [f for f, a, b in zip(KEY_FIELDS, old_key, key) if a != b]
        for f in changed or ["off"]:
            self.reasons[f] = self.reasons.get(f, 0) + 1

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


def material_change(live: Published, published: Published, config: RouterConfig) -> str:
    """What in `live` differs from `published` enough to republish (module docstring): the
    first such part's name, "" when nothing did."""
    seconds = config.decision_time_tolerance * published.scale
    checks = (
        ("failed", lambda: live.failed != published.failed),
        ("jumps", lambda: live.jumps != published.jumps),
        ("refresh", lambda: live.observed - published.observed >= config.decision_refresh),
        ("priors", lambda: moved(live.priors, published.priors, config.decision_tolerance, config.prune_below)),
        ("hits", lambda: moved(live.hits, published.hits, config.decision_hit_tolerance, config.prune_below)),
        ("steps", lambda: moved(live.steps, published.steps, seconds)),
        ("times", lambda: moved(live.times, published.times, seconds)),
    )
    return next((name for name, check in checks if check()), "")


def decision_key(batch_size: int, context_bucket: int, mode: str, chain: Chain | None,
                 version: int, request_version: int, certain: float = 0.0) -> tuple:
    """What step 1 depends on (module docstring): equal keys, equal PlanTables."""
    return (batch_size, context_bucket, mode, chain, version, request_version, certain)


def decision_z(config: RouterConfig, mode: str) -> float:
    """Standard errors a decision takes off a request's estimates in `mode` (RouterConfig)."""
    return config.decision_margin_greedy if mode == GREEDY else config.decision_margin_sampling


def decision_margin(p: float, n: float, z: float) -> float:
    """`p` less `z` standard errors of a rate estimated from `n` trials (its prior's included),
    sqrt(p (1 - p) / n); at least 0. Why (docs/router.md, floor19): at t=0.7 the plans the router
    chose at draft length 2-3 were predicted at a draft acceptance of 0.36-0.43 where 0.22-0.27
    came (chat, prose; static draft>target accepts ~iid at 0.25-0.29 per position there): a
    plan is chosen where its estimate is high, and the estimate is often high by chance."""
    if z <= 0.0 or n <= 0.0:
        return p
    return max(0.0, p - z * math.sqrt(max(p * (1.0 - p), 0.0) / n))


def own_trials(router, req, key: tuple) -> float:
    """The trials behind a request's estimate of a pair or a triple (`Router.alpha`): its own
    decayed trials, the prior's pseudo-trials and, for a model pair whose D_TV the request
    measured, its SimScore's (`request_tv_weight` per position, up to `request_tv_cap`)."""
    cfg = router.config
    c = req.counts.get(key)
    n = cfg.request_prior_strength + (c[0] + c[1] if c is not None else 0.0)
    if len(key) == 2 and key[0] not in router.model_free:
        own = req.sim_score(key)
        if own is not None:
            n += min(cfg.request_tv_cap, cfg.request_tv_weight * own[1])
    return n


def certain_bucket(rate: float) -> float:
    """A row's certain-draft rate (RowContext.certain_rate) as planned: quarters, at most 4."""
    return min(round(rate * 4) / 4, 4.0) if rate > 0.0 else 0.0


class EvidenceBoard:
    """The published evidence of one `Router` (module docstring): the snapshot decide() reads,
    each request's published estimates, and what is cached per published version (the cost
    rows T_M(b, ., L), profile predictions). The router reports what it learns (`note_*`,
    `changed`); the board republishes when that moved materially."""

    def __init__(self, router):
        self.router = router  # policy.Router: its estimates, profile and settings
        self.published: Published | None = None
        self.modes: set[str] = set()  # decoding modes decided for (their priors are published)
        self._seen: tuple = ()  # what the published evidence was last checked against
        self._changes = 0  # router-side changes of evidence since (overheads, releases, failures)
        self._cost_cache: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
        self._cost_version = -1  # the published version the cost rows are of
        self._free_cache: dict[tuple, ModelFreeDraft] = {}  # free_draft's, as the cost rows
        self._predict_cache: dict[tuple[str, int, float, int], float] = {}
        self._predict_version = -1
        self._rows_cache: dict[tuple, dict] = {}  # chain_rows: per cost context, chain key -> (latency, tokens)
        self._rows_version = -1
        self.publications: dict[str, int] = {}  # why the evidence was republished: count per reason

    def changed(self) -> None:
        """Router-side evidence changed (an overhead, a release, a failure, a new mode, the
        router's own decide() time): look again before the next decision."""
        self._changes += 1

    def current(self) -> Published:
        """The evidence decide() reads, republished first when the live one moved materially."""
        r = self.router
        seen = (r.similarity.version, r.profile.version, self._changes)
        if self.published is None or seen != self._seen:
            self._seen = seen
            live = self._snapshot()
            reason = "first" if self.published is None else material_change(live, self.published, r.config)
            if reason:
                self.publications[reason] = self.publications.get(reason, 0) + 1
                version = 0 if self.published is None else self.published.version + 1
                self.published = dataclasses.replace(live, version=version)
        return self.published

    def _snapshot(self) -> Published:
        """The live evidence (version -1)."""
        r = self.router
        L = r.config.context_bucket // 2
        steps = {m: r.profile.predict(m, 1, 1, L) for m in r.order if m in r.profile}
        return Published(
            version=-1,
            priors={**{(p, mode): r.request_prior(p, mode) for mode in sorted(self.modes) for p in r.pairs},
                    **{(t, mode): r.similarity.alpha(t, mode) for mode in sorted(self.modes) for t in r.triples}},
            hits={d: r.similarity.hit_rate(d) for d in sorted(r.model_free)},
            times={**r.overhead, "router": r.decide_seconds},
            steps=steps,
            jumps=dict(r.profile.jumps),
            failed=frozenset(r.failed),
            scale=steps[r.target],
            observed=r.observed_steps,
        )

    def request_evidence(self, req, mode: str) -> RequestEvidence:
        """A request's published alphas and hit rates (the global ones for None), recomputed
        when the router's or the request's evidence version moved."""
        r = self.router
        published = self.current()
        stamp = (published.version, req.version if req is not None else -1, mode)
        if req is not None and req.evidence is not None and req.evidence.stamp == stamp:
            return req.evidence
        digits = r.config.alpha_decimals  # rounding: plan cache hits
        evidence = RequestEvidence(stamp, {p: round(self.alpha(req, p, mode), digits) for p in [*r.pairs, *r.triples]},
                                   {d: self.hit_rate(req, d) for d in r.model_free})
        if req is not None:
            req.evidence = evidence
        return evidence

    def alpha(self, req, pair: Pair, mode: str) -> float:
        """A request's alpha of `pair` (or a triple) as decisions read it: `Router.alpha` less
        the mode's `decision_margin` standard errors (`decision_margin`, `own_trials`)."""
        r = self.router
        value = r.alpha(pair, mode, req)
        z = decision_z(r.config, mode)
        if req is None or z <= 0.0:
            return value
        return decision_margin(value, own_trials(r, req, pair), z)

    def hit_rate(self, req, drafter: str) -> float:
        """A request's hit rate of a model-free drafter as decisions read it (`alpha`): its own
        decayed proposals plus the prior's pseudo-proposals."""
        r = self.router
        value = r.hit_rate(drafter, req)
        z = decision_z(r.config, GREEDY if req is None or req.greedy else SAMPLING)
        if req is None or z <= 0.0:
            return value
        h = req.hits.get(drafter)
        return decision_margin(value, (h[1] if h is not None else 0.0) + r.config.request_hit_prior_strength, z)

    def note_alpha(self, req, pair: Pair, mode: str) -> None:
        """The request's own alpha of `pair` was updated: a new request version if it moved
        materially since published."""
        evidence, cfg = req.evidence, self.router.config
        if evidence is None:
            return
        published = evidence.alphas.get(pair)
        if (published is None or evidence.stamp[2] != mode
                or crossed(self.alpha(req, pair, mode), published, cfg.decision_tolerance, cfg.prune_below)):
            req.version += 1

    def note_hit(self, req, drafter: str) -> None:
        """As `note_alpha`, for the request's hit rate of a model-free drafter."""
        evidence, cfg = req.evidence, self.router.config
        if evidence is None:
            return
        published = evidence.hits.get(drafter)
        if published is None or crossed(self.hit_rate(req, drafter), published,
                                        cfg.decision_hit_tolerance, cfg.prune_below):
            req.version += 1

    def cost_rows(self, b: int, L: int, width: int) -> dict[str, np.ndarray]:
        """T_M(b, t, L) for t = 0..width per model, cached until the evidence is republished."""
        r = self.router
        version = self.current().version
        if version != self._cost_version:
            self._cost_cache.clear()
            self._free_cache.clear()
            self._cost_version = version
        bucket = r.config.context_bucket
        key = (b, L // bucket, width)
        rows = self._cost_cache.get(key)
        if rows is None:
            L_mid = (L // bucket) * bucket + bucket // 2
            rows = {m: r.profile.cost_row(m, b, L_mid, width) if m in r.profile
                    else np.zeros(width + 1) for m in r.order}  # an unprofiled model-free drafter: free
            self._cost_cache[key] = rows
        return rows

    def free_draft(self, rows: dict[str, np.ndarray], drafter: str, hit_rate: float) -> ModelFreeDraft:
        """`ModelFreeDraft(rows[drafter], hit_rate)` of cost rows this board made (`cost_rows`),
        made once per hit rate while they are cached (every decision reads them)."""
        key = (id(rows), drafter, hit_rate)
        draft = self._free_cache.get(key)
        if draft is None or draft.cost is not rows[drafter]:
            draft = self._free_cache[key] = ModelFreeDraft(cost=rows[drafter], hit_rate=hit_rate)
        return draft

    def chain_rows(self, context: tuple) -> dict:
        """The PlanTable rows (latency, tokens per k) of chains already evaluated on the cost
        context `context` (batch size, context bucket, processors, certain bucket, the router's
        seconds per cycle) under the published evidence, keyed by `policy.chain_key` (the
        estimates a chain reads): a request whose own estimates moved re-evaluates only the
        chains that read them. Cleared when the evidence is republished, as the cost rows are."""
        version = self.current().version
        if version != self._rows_version:
            self._rows_cache.clear()
            self._rows_version = version
        rows = self._rows_cache.get(context)
        if rows is None:
            if len(self._rows_cache) >= 64:  # many rows' contexts under load: keep it small
                self._rows_cache.clear()
            rows = self._rows_cache[context] = {}
        return rows

    def rows_for(self, row, router: float) -> dict:
        """`chain_rows` of a row's cost context (batch size, context bucket, processors, certain
        bucket, `router`: the router's seconds per cycle its plans are charged)."""
        cfg = self.router.config
        processors = row.processors and self.current().times["processor"] > 0.0
        return self.chain_rows((max(row.batch_size, 1), max(row.context_len, 1) // cfg.context_bucket,
                                processors, certain_bucket(row.certain_rate), router))

    def predict(self, model: str, b: int, t: float, L: int, publish: bool = True) -> float:
        """profile.predict, cached per (model, b, t, L bucket) until the evidence is republished.
        `publish=False` (observing a step) reads the evidence as published without checking it
        first: only planning publishes, so when evidence is published does not depend on what
        else reads it."""
        r = self.router
        version = (self.current() if publish or self.published is None else self.published).version
        if version != self._predict_version:
            self._predict_cache.clear()
            self._predict_version = version
        bucket = r.config.context_bucket
        key = (model, b, t, L // bucket)
        v = self._predict_cache.get(key)
        if v is None:
            v = self._predict_cache[key] = r.profile.predict(model, b, t, (L // bucket) * bucket + bucket // 2)
        return v


class TvSchedule:
    """Which steps measure D_TV (`RouterProtocol.measure_tv`, set by every `plan_batch` for the
    step it plans): measuring it at a row's first `tv_positions` candidates is a softmax over the
    vocabulary per position and level, 0.5-0.6 ms of a sampled single stream's ~12 ms cycle on a
    Sapphire Rapids through torch (~0.1 ms a measuring step since session 19's native kernel,
    kernels/tv.cpp; measuring every step was still no faster end to end), paid by every speculative cycle while nothing read from it moved a decision
    after a request's first cycles (docs/router.md, 2026-12-06). So a step measures it when one
    of its rows is in its first `tv_first_cycles` cycles (a request's own SimScore is its prior
    from its first cycle, `Router.alpha`), and every `tv_every`-th step with a row it would
    measure besides (the calibration, the drift and the global SimScores keep learning).
    `tv_every` 1: every step, as before. A step of pinned rows only counts as one with a row
    to measure (their D_TV feeds the estimator too)."""

    def __init__(self, measure: bool, every: int, first_cycles: int):
        self.measure, self.every, self.first = measure, every, first_cycles
        self.steps = 0  # steps with a row it would measure

    def wants(self, rows, requests: Mapping) -> bool:
        """Whether the step of `rows` (RowContext) measures D_TV; `requests`: the router's."""
        if not self.measure:
            return False
        free = bool(rows)
        rows = [r for r in rows if not r.greedy]
        if free and not rows:  # greedy rows only, whose D_TV is not read
            return False
        self.steps += 1
        if self.every <= 1 or self.steps % self.every == 0:
            return True
        for r in rows:
            req = requests.get(r.seq_id)
            if req is None or req.cycles <= self.first:  # (its first observed cycle is its prefill)
                return True
        return False
