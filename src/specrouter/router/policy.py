"""The router: per request, every cycle, the chain and draft length of least predicted T_eff
(docs/design.md, Pillar 1), with hysteresis, bounded probing and a log of every decision.

Inputs: a `CostProfile` (T_M(b, t, L)), a `SimilarityEstimator` (alpha per pair and mode), the
pool order (cheapest first, target last) and the names of model-free drafters.

1. `decide(RowContext)`: build each model's cost row T_M(b, ., L) for the row's batch size b and
   context length L, each pair's alpha for this request, the model-free drafters' hit rates, and
   evaluate every sub-chain ending at the target (2^(p-1), (target,) included) for k = 1..k_max
   with `cost_model.best_plan`. The per-cycle overheads are charged on top: the engine's own
   (cycle wall time minus forward time, learned separately for plain and speculative cycles) and
   the router's (its measured decide() time times the batch rows).
   A plan whose first level is a model-free drafter also carries `Decision.min_confidence`, its
   break-even acceptance (`cost_model.break_even_confidence`: the verifiers' extra seconds per
   candidate over the plan's T_eff); a confidence-sized drafter (suffix) proposes up to k tokens
   but stops before its cumulative confidence drops below it, so its draft length follows its
   own confidence where verifying is dear (big batches) and k where it is cheap.
2. Hysteresis: keep the current (chain, k) unless the best is predicted faster by more than
   `switch_margin` (5%), or the current one has been predicted slower than the best by more
   than `persist_margin` (1%) for `patience` (16) decisions in a row. Hysteresis is for noise,
   not for a change of regime: when the profile's step detector fired for a model of the plan
   (it slowed down or sped up), a gain above `persist_margin` switches at once ("changed").
   And plain decoding is the safe default: a speculative plan not predicted to beat it by more
   than `persist_margin` falls back to it at once ("fallback").
3. Probing: pairs with little (or faded) evidence (`needs_probe`) get their optimistic alpha
   (a Wilson upper bound); when the `ProbeBudget` allows (5% of row-cycles, 2% of wall time)
   and a chain measuring one of them could beat the plan in that optimistic world, this one
   cycle runs it (the pair probed least recently first), at its best k up to `probe_k`; its
   expected extra cost over the plan is charged to the budget. Refuted pairs stop being probed
   until their evidence fades.
4. `observe_step(rows, forwards, wall_time, forward_time, speculative)`, once per engine step:
   acceptance trials (global and per request), D_TV, hit rates, forward timings into the
   profile, step overheads, the batch calibration (router/batch.py). (`observe_cycle`, one
   chain's cycle without the batch calibration, is what the simulated-pool tests still feed.)
5. The decision cache (router/evidence.py): decide() reads the evidence as published, which
   changes only when the live estimates move materially (or a model fails or slows down), and
   step 1 (the PlanTable, the expensive part) is reused per row while its key holds: the same
   batch size, context bucket, k cap, chain and evidence versions. Steps 2-3 run every call.

Per request (a request type is implicit: code, prose, chat): each request keeps its own decayed
acceptance counts per pair and hit counts per model-free drafter; its alpha is its own estimate
shrunk toward the global one (empirical Bayes: (accepted + n0 * global) / (trials + n0) with
n0 = `request_prior_strength` pseudo-trials, over a window of ~200 trials), so a request with
little evidence runs on the prior and one that differs (code vs prose) soon on its own. For a
model pair the prior is optimistic: the global alpha, or if higher the `request_prior_quantile`
(0.75) of the alphas that recent finished requests reached on their own evidence. The global
mean of a mixed stream is the alpha of no request type, and starting below a type's own rate
would keep that type from ever trying the draft it gains from; starting at an upper quantile
costs at most a few cycles on a request type that does not. (A model-free drafter keeps the
global alpha: a pessimistic prior was tried and cost the extraction requests their first
cycles more than it saved on chat.) Model-free drafters can be
shadow-scored for free every cycle (`observe_shadow`), so a request's n-gram estimate is always
its own.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from specrouter.config import RouterConfig
from specrouter.records.stats import CycleStats
from specrouter.router.cost_model import (
    ModelFreeDraft,
    PlanTable,
    best_plan,
    break_even_confidence,
    enumerate_chains,
)
from specrouter.router.batch import (StepCalibration, observe_batch_step, plan_batch, step_seconds,
                                     take_confident_drafts)
from specrouter.router.evidence import (
    CachedPlans,
    CacheStats,
    Published,
    RequestEvidence,
    crossed,
    decision_key,
    material_change,
)
from specrouter.router.profile import CostProfile
from specrouter.records.routing import (  # noqa: F401  (re-exported: the router's public boundary)
    Chain,
    Decision,
    DecisionEvent,
    ForwardRecord,
    RowContext,
    RowOutcome,
)
from specrouter.router.request_state import FinishedRequests, RequestState
from specrouter.router.similarity import (
    GREEDY,
    SAMPLING,
    Pair,
    ProbeBudget,
    SimilarityEstimator,
    acceptance_trials,
    shadow_match,
    shrink,
)

# ---------------------------------------------------------------------------------------------
# the router


class Router:
    """Chooses (chain, k) per request per cycle; see the module docstring."""

    def __init__(
        self,
        order: Sequence[str],
        target: str,
        profile: CostProfile,
        similarity: SimilarityEstimator | None = None,
        *,
        model_free: Collection[str] = (),
        first_only: Collection[str] = (),
        packed: Collection[str] = (),
        sizes: Mapping[str, int] | None = None,
        config: RouterConfig | None = None,
        on_decision: Callable[[DecisionEvent], None] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.config = cfg = config or RouterConfig()
        if target not in order:
            raise ValueError(f"target {target!r} is not in the pool order {list(order)}")
        self.order = list(order)
        self.target = target
        self.model_free = frozenset(model_free)
        # drafters that never verify: model-free ones and draft heads (models/heads/level.py)
        self.first_only = self.model_free | frozenset(first_only)
        self.packed = frozenset(packed)  # models whose ragged forwards cost their valid tokens
        unprofiled = [m for m in self.order if m not in profile and m not in self.model_free]
        if unprofiled:
            raise ValueError(f"no cost profile for {unprofiled}: run specrouter.router.profile.sweep() or CostProfile.load()")
        self.profile = profile
        self.similarity = similarity or SimilarityEstimator(sizes, self.model_free, cfg.similarity)
        self.budget = ProbeBudget(cfg.probe_fraction, cfg.probe_time_fraction)
        self.on_decision = on_decision
        self.timer = timer  # measures decide() (real time, also under a virtual clock)
        self.chains: list[Chain] = [
            c for c in enumerate_chains(self.order, target, cfg.max_levels)
            if not any(m in self.first_only for m in c[1:])
        ]
        self._chain_index = {c: i for i, c in enumerate(self.chains)}
        self.pairs: list[Pair] = sorted({p for c in self.chains for p in zip(c[:-1], c[1:])},
                                        key=lambda p: (self.order.index(p[0]), self.order.index(p[1])))
        self._pair_chains = {p: [i for i, c in enumerate(self.chains) if p in zip(c[:-1], c[1:])]
                             for p in self.pairs}  # chains that measure the pair
        self.requests: dict[int, RequestState] = {}
        self.events: deque[DecisionEvent] = deque(maxlen=cfg.log_size)
        self.overhead = {"plain": 0.0, "spec": 0.0}  # seconds per cycle outside forwards
        self.decide_seconds = 0.0  # EMA of decide() wall time
        self._cost_cache: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
        self._cost_version = -1  # the published version the cost rows are of
        self._predict_cache: dict[tuple[str, int, int, int], float] = {}
        self._predict_version = -1
        self.batch_events: deque = deque(maxlen=cfg.log_size)  # (row-cycle, rows, reason, rate, plain rate)
        self._t_width = cfg.k_max + cfg.max_levels + 2
        self._next_probe_check = 0  # row-cycle from which _probe is worth computing again
        self._probes: dict[Pair, tuple[int, float, int]] = {}  # pair -> (row-cycle, trials then, back-off)
        self._model_seen: dict[str, int] = {}  # row-cycle each model was last timed
        # the alphas finished requests reached on their own, and their quantile (request_prior)
        self.finished = FinishedRequests(cfg.request_history, cfg.request_prior_quantile or 0.5,
                                         cfg.request_min_trials, cfg.request_min_finished)
        # the decision cache (router/evidence.py)
        self.failed: set[str] = set()  # models out of service (mark_failed)
        self.cache_stats = CacheStats()
        self._modes: set[str] = set()  # decoding modes decided for (their priors are published)
        self._published: Published | None = None
        self._seen: tuple = ()  # what the published evidence was last checked against
        self._changes = 0  # router-side changes of evidence since (overheads, releases, failures)
        self._observed = 0  # observed steps
        self.plain_hold = None  # batch.PlainHold while the batch stays plain without re-planning
        self.held_decisions = 0  # row decisions the plain hold made (they log no DecisionEvent)
        # (rows, speculative) -> batch.StepCalibration: multi-row steps' realised / predicted rates
        self.batch_calibration: dict[tuple[int, bool], StepCalibration] = {}
        self.plan_seconds = 0.0  # the router's planning of the step being run (batch.observe_batch_step)

    @property
    def observed_steps(self) -> int:
        """Engine steps observed so far (the clock of the plain hold, router/batch.py)."""
        return self._observed

    @classmethod
    def from_pool(cls, pool, profile: CostProfile, **kwargs) -> "Router":
        """A router over a `Pool` (its order, target, model sizes and model-free drafters)."""
        sizes = {n: int(getattr(r, "num_params", 0)) for n, r in pool.runners.items()}
        packed = {n for n, r in pool.runners.items() if getattr(r, "packs_ragged", False)}
        return cls(pool.order, pool.target, profile, model_free=set(pool.drafters),
                   first_only=set(getattr(pool, "heads", ())), packed=packed, sizes=sizes, **kwargs)

    # -- estimates --------------------------------------------------------------------------
    def _request(self, seq_id: int, greedy: bool) -> RequestState:
        req = self.requests.get(seq_id)
        if req is None:
            req = self.requests[seq_id] = RequestState(greedy=greedy)
        return req

    def alpha(self, pair: Pair, mode: str, req: RequestState | None = None) -> float:
        """The acceptance estimate of a pair for a request (global when req is None)."""
        glob = self.similarity.alpha(pair, mode)
        if req is None:
            return glob
        prior = self.request_prior(pair, mode, glob)
        c = req.counts.get(pair)
        if c is None:
            return prior
        return shrink(c[0], c[0] + c[1], prior, self.config.request_prior_strength)

    def request_prior(self, pair: Pair, mode: str, glob: float | None = None) -> float:
        """A request's prior alpha for a pair (module docstring): max(global, the quantile of
        finished requests' own alphas); the global alpha for model-free drafters and before 3
        finished requests."""
        glob = self.similarity.alpha(pair, mode) if glob is None else glob
        if self.config.request_prior_quantile is None or pair[0] in self.model_free:
            return glob
        edge = self.finished.quantile(pair, mode)
        return glob if edge is None else max(glob, edge)

    def hit_rate(self, drafter: str, req: RequestState | None = None) -> float:
        glob = self.similarity.hit_rate(drafter)
        h = req.hits.get(drafter) if req is not None else None
        if h is None:
            return glob
        return shrink(h[0], h[1], glob, self.config.request_hit_prior_strength)

    def _cost_rows(self, b: int, L: int) -> dict[str, np.ndarray]:
        """T_M(b, t, L) for t = 0..width per model, cached until the evidence is republished."""
        version = self._evidence().version
        if version != self._cost_version:
            self._cost_cache.clear()
            self._cost_version = version
        bucket = self.config.context_bucket
        key = (b, L // bucket, self._t_width)
        rows = self._cost_cache.get(key)
        if rows is None:
            L_mid = (L // bucket) * bucket + bucket // 2
            rows = {m: self.profile.cost_row(m, b, L_mid, self._t_width) if m in self.profile
                    else np.zeros(self._t_width + 1) for m in self.order}  # an unprofiled model-free drafter: free
            self._cost_cache[key] = rows
        return rows

    def _inputs(self, row: RowContext, req: RequestState | None):
        """(costs, alphas, router seconds per cycle) of a row for best_plan, from the published
        evidence (evidence.py)."""
        mode = GREEDY if row.greedy else SAMPLING
        published = self._evidence()
        rows = self._cost_rows(max(row.batch_size, 1), max(row.context_len, 1))
        evidence = self._request_evidence(req, mode)
        costs: dict[str, object] = dict(rows)
        for d in self.model_free:
            costs[d] = ModelFreeDraft(cost=rows[d], hit_rate=evidence.hits[d])
        return costs, dict(evidence.alphas), published.times["router"] * max(row.batch_size, 1)

    def _viable(self, chain: Chain, costs, alphas) -> bool:
        """False for a chain that cannot beat plain decoding: a pair that (almost) never
        accepts, or a model-free drafter that (almost) never proposes. Pruning them makes
        decide() cheap exactly when speculation is useless."""
        cfg = self.config
        if chain[0] in self.model_free and costs[chain[0]].hit_rate < cfg.prune_below:
            return False
        return all(alphas[p] >= cfg.prune_below for p in zip(chain[:-1], chain[1:]))

    def _table(self, costs, alphas, router: float, k_cap: int, keep: int | None = None,
               prune: bool = True) -> PlanTable:
        """best_plan over the viable chains (and `keep`), with every overhead, as a PlanTable over
        all chains: t_eff (C, K) is +inf and the expectations NaN for pruned ones and for those
        with a failed model."""
        published = self._evidence()
        idx = [i for i, c in enumerate(self.chains) if i == 0 or (
            published.failed.isdisjoint(c) and (not prune or i == keep or self._viable(c, costs, alphas)))]
        plan = best_plan([self.chains[i] for i in idx], k_cap, costs=costs, alphas=alphas,
                         overhead=published.times["spec"] + router)
        shape = (len(self.chains), k_cap)
        t, latency, tokens = np.full(shape, np.inf), np.full(shape, np.nan), np.full(shape, np.nan)
        t[idx], latency[idx], tokens[idx] = plan.table.t_eff, plan.table.expected_latency, plan.table.expected_tokens
        t[0] += published.times["plain"] + router  # chains[0] is (target,): one token per cycle
        latency[0] += published.times["plain"] + router
        return PlanTable(chains=tuple(self.chains), ks=plan.table.ks, t_eff=t, expected_tokens=tokens,
                         expected_latency=latency)

    def evaluate(self, row: RowContext, req: RequestState | None = None, k_cap: int | None = None,
                 prune: bool = False) -> tuple[PlanTable, dict[Pair, float]]:
        """(PlanTable with all overheads, alphas) of a row: what decide() takes the argmin of,
        for display (`specrouter profile`) and tests."""
        costs, alphas, router = self._inputs(row, req)
        k_cap = self.config.k_max if k_cap is None else k_cap
        return self._table(costs, alphas, router, k_cap, prune=prune), alphas

    # -- published evidence (router/evidence.py) ---------------------------------------------
    def _evidence(self) -> Published:
        """The evidence decide() reads, republished first when the live one moved materially."""
        seen = (self.similarity.version, self.profile.version, self._changes)
        if self._published is None or seen != self._seen:
            self._seen = seen
            live = self._snapshot()
            if self._published is None or material_change(live, self._published, self.config):
                version = 0 if self._published is None else self._published.version + 1
                self._published = dataclasses.replace(live, version=version)
        return self._published

    def _snapshot(self) -> Published:
        """The live evidence (version -1)."""
        L = self.config.context_bucket // 2
        steps = {m: self.profile.predict(m, 1, 1, L) for m in self.order if m in self.profile}
        return Published(
            version=-1,
            priors={(p, mode): self.request_prior(p, mode) for mode in sorted(self._modes) for p in self.pairs},
            hits={d: self.similarity.hit_rate(d) for d in sorted(self.model_free)},
            times={"plain": self.overhead["plain"], "spec": self.overhead["spec"], "router": self.decide_seconds},
            steps=steps,
            jumps=dict(self.profile.jumps),
            failed=frozenset(self.failed),
            scale=steps[self.target],
            observed=self._observed,
        )

    def _request_evidence(self, req: RequestState | None, mode: str) -> RequestEvidence:
        """A request's published alphas and hit rates (the global ones for None), recomputed
        when the router's or the request's evidence version moved."""
        published = self._evidence()
        stamp = (published.version, req.version if req is not None else -1, mode)
        if req is not None and req.evidence is not None and req.evidence.stamp == stamp:
            return req.evidence
        digits = self.config.alpha_decimals  # rounding: plan cache hits
        evidence = RequestEvidence(stamp, {p: round(self.alpha(p, mode, req), digits) for p in self.pairs},
                                   {d: self.hit_rate(d, req) for d in self.model_free})
        if req is not None:
            req.evidence = evidence
        return evidence

    def _note_alpha(self, req: RequestState, pair: Pair, mode: str) -> None:
        """The request's own alpha of `pair` was updated: a new request version if it moved
        materially since published."""
        evidence = req.evidence
        if evidence is None:
            return
        published = evidence.alphas.get(pair)
        if (published is None or evidence.stamp[2] != mode
                or crossed(self.alpha(pair, mode, req), published, self.config.decision_tolerance,
                           self.config.prune_below)):
            req.version += 1

    def _note_hit(self, req: RequestState, drafter: str) -> None:
        """As `_note_alpha`, for the request's hit rate of a model-free drafter."""
        evidence = req.evidence
        if evidence is None:
            return
        published = evidence.hits.get(drafter)
        if published is None or crossed(self.hit_rate(drafter, req), published,
                                        self.config.decision_hit_tolerance, self.config.prune_below):
            req.version += 1

    def mark_failed(self, model: str) -> None:
        """`model` is out of service (engine/faults.py): no plan uses it from now on, and every
        cached decision is dropped at once (the evidence is republished)."""
        if model != self.target and model not in self.failed:
            self.failed.add(model)
            self._changes += 1

    # -- deciding ---------------------------------------------------------------------------
    def decide(self, row: RowContext) -> Decision:
        """The (chain, k) this row runs next cycle (module docstring, steps 1-3); step 1 (the
        PlanTable) is reused while the row's decision key holds (router/evidence.py)."""
        t0 = self.timer()
        cfg = self.config
        req = self._request(row.seq_id, row.greedy)
        mode = GREEDY if row.greedy else SAMPLING
        if mode not in self._modes:
            self._modes.add(mode)
            self._changes += 1  # its priors are watched from now on
        k_cap = cfg.k_max if row.remaining is None else min(cfg.k_max, row.remaining - 1)
        prev = req.plan
        plain = (self.target,)
        if k_cap < 1 or len(self.chains) == 1:
            t_plain = float(self._cost_rows(max(row.batch_size, 1), max(row.context_len, 1))[self.target][1])
            req.plan, req.worse, req.table = (plain, 0), 0, None
            decision = Decision(plain, 0, t_plain, "end" if k_cap < 1 else "only")
            return self._log(row, req, mode, decision, prev, (plain, 0), t_plain, t_plain, {}, t0)
        key = self._decision_key(row, req, mode, k_cap)
        plans = req.cached
        if cfg.decision_cache and plans is not None and plans.key == key:
            self.cache_stats.hits += 1
        else:
            self.cache_stats.misses += 1
            plans = req.cached = self._plans(row, req, k_cap, key)
        decision = self._hysteresis(req, plans, k_cap)
        if self.budget.allow() and self.similarity.now >= self._next_probe_check:
            decision = self._probe_decision(row, req, mode, k_cap, decision)
        return self._log(row, req, mode, decision, prev, plans.best, plans.t_best, plans.t_plain,
                         req.evidence.alphas, t0)

    def _decision_key(self, row: RowContext, req: RequestState, mode: str, k_cap: int) -> tuple:
        """What step 1 reads (evidence.decision_key)."""
        version = self._evidence().version
        self._request_evidence(req, mode)  # published for this key (the log and _note_alpha read it)
        return decision_key(max(row.batch_size, 1), max(row.context_len, 1) // self.config.context_bucket,
                            mode, k_cap, req.plan[0] if req.plan is not None else None, version, req.version)

    def _plans(self, row: RowContext, req: RequestState, k_cap: int, key: tuple) -> CachedPlans:
        """Step 1: the row's PlanTable (keeping the request's chain) and its argmin."""
        prev = req.plan
        costs, alphas, router = self._inputs(row, req)
        keep = self._chain_index.get(prev[0]) if prev is not None else None
        table = self._table(costs, alphas, router, k_cap, keep=keep)
        t = table.t_eff
        bi, bj = np.unravel_index(int(np.argmin(t)), t.shape)
        return CachedPlans(key, table, costs, self._plan_at(bi, bj), float(t[bi, bj]), float(t[0, 0]))

    def _hysteresis(self, req: RequestState, plans: CachedPlans, k_cap: int) -> Decision:
        """Step 2: keep the request's plan unless the best is enough faster (module docstring);
        updates the request's plan, hysteresis counter and epoch."""
        cfg = self.config
        prev, t, best, t_best = req.plan, plans.table.t_eff, plans.best, plans.t_best
        plain = (self.target,)
        ci = self._chain_index.get(prev[0]) if prev is not None else None
        if prev is None:
            choice, reason = best, "initial"
        elif ci is None:
            choice, reason = best, "invalid"
        else:
            cj = 0 if len(prev[0]) == 1 else min(prev[1], k_cap) - 1
            current = self._plan_at(ci, cj)
            t_cur = float(t[ci, cj])
            changed = self._epoch(prev[0]) != req.epoch  # a model of the plan changed speed
            if current == best:
                choice, reason = current, "same"
                req.worse = 0
            elif t_best < t_cur * (1.0 - cfg.switch_margin):
                choice, reason = best, "better"
            elif changed and t_best < t_cur * (1.0 - cfg.persist_margin):
                choice, reason = best, "changed"
            elif best[0] == plain and t_best < t_cur * (1.0 + cfg.persist_margin):
                choice, reason = best, "fallback"  # speculation predicted to gain < 1%: pure risk
            elif t_cur > t_best * (1.0 + cfg.persist_margin):
                req.worse += 1
                choice, reason = (best, "persistent") if req.worse >= cfg.patience else (current, "hysteresis")
            else:
                choice, reason = current, "hysteresis"
                req.worse = 0
        if choice != prev:
            req.worse = 0
        req.plan, req.epoch, req.table = choice, self._epoch(choice[0]), plans.table
        i, j = self._chain_index[choice[0]], max(choice[1], 1) - 1
        return Decision(choice[0], choice[1], float(t[i, j]), reason, self._floor(plans, choice, float(t[i, j])))

    def _floor(self, plans: CachedPlans, plan: tuple[Chain, int], t_eff: float) -> float:
        """`_confidence_floor` of a plan of `plans`, memoized with them."""
        floor = plans.floors.get(plan)
        if floor is None:
            floor = plans.floors[plan] = self._confidence_floor(plan[0], plan[1], t_eff, plans.costs)
        return floor

    def _probe_decision(self, row: RowContext, req: RequestState, mode: str, k_cap: int,
                        decision: Decision) -> Decision:
        """Step 3: a probe instead of `decision` this one cycle, within the budget (the
        request's plan stays as it is); else `decision`."""
        costs, alphas, router = self._inputs(row, req)
        probe = self._probe(mode, decision.chain, decision.t_eff, costs, alphas, router, k_cap)
        if probe is None:
            self._next_probe_check = self.similarity.now + self.config.probe_recheck
            return decision
        pi, pk = probe
        published = self._evidence()
        one = best_plan([self.chains[pi]], pk, costs=costs, alphas=alphas,
                        overhead=published.times["spec"] + router).table  # as now estimated
        latency, tokens = float(one.expected_latency[0, pk - 1]), float(one.expected_tokens[0, pk - 1])
        self.budget.charge(latency - decision.t_eff * tokens)
        return Decision(self.chains[pi], pk, latency / tokens, "probe",
                        self._confidence_floor(self.chains[pi], pk, latency / tokens, costs))

    def _confidence_floor(self, chain: Chain, k: int, t_eff: float, costs) -> float:
        """Break-even acceptance of one more candidate of a plan whose first level is model-free
        (`cost_model.break_even_confidence`); 0 otherwise."""
        if k < 1 or len(chain) < 2 or chain[0] not in self.model_free:
            return 0.0
        return break_even_confidence([costs[m] for m in chain[1:]], k, t_eff)

    # -- planning the batch (router/batch.py) ------------------------------------------------
    def plan_batch(self, rows: Sequence[RowContext],
                   pinned: Sequence[tuple[Chain, int]] = ()) -> list[Decision]:
        """The plans of a step's rows, chosen for the batch the step really runs
        (`batch.plan_batch`)."""
        return plan_batch(self, rows, pinned)

    def take_confident_drafts(self, rows: Sequence[RowContext], plans: list[tuple[Chain, int]],
                              offers: dict[int, tuple[str, int, float]],
                              pinned: Sequence[tuple[Chain, int]] = ()) -> list[tuple[Chain, int]]:
        """Rows whose model-free drafter offers a confident draft now run it when the step
        gains (`batch.take_confident_drafts`)."""
        return take_confident_drafts(self, rows, plans, offers, pinned)

    def step_seconds(self, plans: Sequence[tuple[Chain, int]], context_len: int) -> float:
        """Predicted seconds of one engine step running `plans` (`batch.step_seconds`)."""
        return step_seconds(self, plans, context_len)

    def predict(self, model: str, b: int, t: int, L: int) -> float:
        """profile.predict, cached per (model, b, t, L bucket) until the evidence is republished."""
        version = self._evidence().version
        if version != self._predict_version:
            self._predict_cache.clear()
            self._predict_version = version
        bucket = self.config.context_bucket
        key = (model, b, t, L // bucket)
        v = self._predict_cache.get(key)
        if v is None:
            v = self._predict_cache[key] = self.profile.predict(model, b, t, (L // bucket) * bucket + bucket // 2)
        return v

    def _epoch(self, chain: Chain) -> tuple[int, ...]:
        jumps = self.profile.jumps
        return tuple(jumps.get(m, 0) for m in chain)

    def _plan_at(self, i: int, j: int) -> tuple[Chain, int]:
        chain = self.chains[i]
        return chain, (0 if len(chain) == 1 else j + 1)

    def _probe(self, mode: str, running: Chain, t_plan: float, costs, alphas, router: float,
               k_cap: int) -> tuple[int, int] | None:
        """(chain index, k) of a probe, or None (optimism under uncertainty, within the budget).

        Candidates: pairs not in the running chain that need a probe (`needs_probe`) get their
        optimistic alpha (`SimilarityEstimator.upper`), and models believed slow (speed > 1.1)
        whose timing is stale (unobserved for `stale_after` row-cycles) their swept speed. A
        candidate pair is worth a probe when some chain measuring it beats the plan (T_eff below
        `t_plan`) in that optimistic world; the most promising one goes, with its best chain at
        that chain's best k up to `probe_k`. A probe that taught nothing about its pair (a
        model-free miss) doubles the wait before that pair's next one."""
        sim, now = self.similarity, self.similarity.now
        busy = set(zip(running[:-1], running[1:]))
        slow = {m for m in self.order if m in self.profile and self.profile.speed(m) > self.config.probe_slow_speed
                and now - self._model_seen.get(m, 0) >= sim.config.stale_after}
        candidates = [p for p in self.pairs if p not in busy
                      and (sim.needs_probe(p, mode) or slow.intersection(p))
                      and now >= self._probe_ready(p, mode)]
        if not candidates:
            return None
        hopeful = dict(alphas)
        for p in candidates:
            if sim.needs_probe(p, mode):
                hopeful[p] = max(alphas[p], round(sim.upper(p, mode, self.config.probe_optimism),
                                                  self.config.alpha_decimals))
        hopeful_costs = dict(costs)
        for m in slow:  # it may have recovered while nobody looked
            if isinstance(costs[m], np.ndarray):
                hopeful_costs[m] = costs[m] / self.profile.speed(m)
        t = self._table(hopeful_costs, hopeful, router, k_cap).t_eff
        best = None  # (optimistic T_eff, pair, chain index, k index)
        for p in candidates:
            for i in self._pair_chains[p]:
                j = int(np.argmin(t[i]))
                if t[i, j] < t_plan and (best is None or t[i, j] < best[0]):
                    best = (float(t[i, j]), p, i, j)
        if best is None:
            return None
        _, p, i, j = best
        last = self._probes.get(p)
        wait = 0 if last is None or self._taught(p, mode, last) else max(2 * last[2], self.config.probe_recheck)
        longest = int(self.config.probe_max_wait * sim.config.stale_after)
        self._probes[p] = (now, sim.stats(p, mode).trials, min(wait, longest))
        return i, min(j + 1, self.config.probe_k)

    def _taught(self, pair: Pair, mode: str, last: tuple[int, float, int]) -> bool:
        return self.similarity.stats(pair, mode).trials > last[1] + 0.5

    def _probe_ready(self, pair: Pair, mode: str) -> int:
        """Row-cycle from which the pair may be probed again: at once if its last probe taught
        something, else after twice the previous wait (back-off)."""
        last = self._probes.get(pair)
        if last is None or self._taught(pair, mode, last):
            return 0
        return last[0] + max(2 * last[2], self.config.probe_recheck)

    def _log(self, row, req, mode, decision, prev, best, t_best, t_plain, alphas, t0) -> Decision:
        elapsed = self.timer() - t0
        a = self.config.overhead_alpha
        self.decide_seconds += a * (elapsed - self.decide_seconds) if self.decide_seconds else elapsed
        published = self._published
        if abs(self.decide_seconds - published.times["router"]) > self.config.decision_time_tolerance * published.scale:
            self._changes += 1  # the router's own time moved materially: republish before the next decision
        event = DecisionEvent(
            step=self.similarity.now, seq_id=row.seq_id, chain=decision.chain, k=decision.k,
            t_eff=decision.t_eff, reason=decision.reason, switched=prev is not None and req.plan != prev,
            best_chain=best[0], best_k=best[1], best_t_eff=t_best, plain_t_eff=t_plain,
            batch_size=row.batch_size, context_len=row.context_len, mode=mode, alphas=alphas,
            decide_seconds=elapsed,
        )
        self.events.append(event)
        if self.on_decision is not None:
            self.on_decision(event)
        return decision

    # -- observing --------------------------------------------------------------------------
    def observe_cycle(
        self,
        stats: CycleStats | None,
        rows: Sequence[RowOutcome],
        forwards: Sequence[ForwardRecord] | None = None,
    ) -> None:
        """Learn from one executor cycle: `rows` are its per-row outcomes; `forwards` its timed
        forwards (without them, timings are attributed from `stats` approximately)."""
        self._observe_rows(rows)
        if forwards is None and stats is not None and rows:  # shapes approximated from the stats
            forwards = self._forwards_from_stats(stats, rows)
        self._observe_forwards(forwards or ())
        if stats is not None:
            for name in stats.forward_time:
                self._model_seen[name] = self.similarity.now
            self._observe_overhead(stats.wall_time, sum(stats.forward_time.values()), len(stats.chain) > 1)
        self._tick(rows, stats.wall_time if stats is not None else 0.0)

    def observe_step(self, rows: Sequence[RowOutcome], forwards: Sequence[ForwardRecord],
                     wall_time: float, forward_time: float, speculative: bool) -> None:
        """Learn from one engine step (every row, every model's forwards of the step)."""
        observe_batch_step(self, rows, forwards, wall_time)
        self._observe_rows(rows)
        self._observe_forwards(forwards)
        self._observe_overhead(wall_time, forward_time, speculative)
        self._tick(rows, wall_time)

    def _observe_rows(self, rows: Sequence[RowOutcome]) -> None:
        """Acceptance trials, hit rates and D_TV of every row, per mode (greedy evidence only
        from greedy rows)."""
        cfg = self.config
        sim = self.similarity
        for r in rows:
            mode = GREEDY if r.greedy else SAMPLING
            req = self._request(r.seq_id, r.greedy)
            req.cycles += 1
            chain = tuple(r.chain)
            for j in range(1, len(chain)):
                pair = (chain[j - 1], chain[j])
                cand, acc = int(r.drafted[j]), int(r.accepted[j])
                proposal_len = None
                if j == 1 and chain[0] in self.model_free:
                    hit = int(r.drafted[0]) > 0
                    sim.observe_hits(chain[0], int(hit), 1)
                    req.observe_hit(chain[0], hit, cfg.request_hit_decay)
                    self._note_hit(req, chain[0])
                    proposal_len = r.k
                a, rej = acceptance_trials(cand, acc, proposal_len)
                if a + rej:
                    sim.observe_acceptance(pair, mode, a, rej)
                    req.observe(pair, a, rej, cfg.request_decay)
                    self._note_alpha(req, pair, mode)
                else:
                    sim.touch(pair, mode)
                if r.tv is not None and j < len(r.tv) and r.tv[j] is not None and math.isfinite(r.tv[j]):
                    sim.observe_tv(pair, mode, float(r.tv[j]), cand)

    def _observe_forwards(self, forwards: Sequence[ForwardRecord]) -> None:
        now = self.similarity.now
        for f in forwards:
            self._model_seen[f.model] = now
            if f.model in self.profile:
                self.profile.observe(f.model, f.rows, f.new_tokens, f.context_len, f.seconds, f.count)

    def _observe_overhead(self, wall_time: float, forward_time: float, speculative: bool) -> None:
        key = "spec" if speculative else "plain"
        self.overhead[key] += self.config.overhead_alpha * (max(wall_time - forward_time, 0.0) - self.overhead[key])
        self._changes += 1

    def _tick(self, rows: Sequence[RowOutcome], wall_time: float) -> None:
        self.similarity.tick(len(rows))
        self.budget.tick(len(rows), wall_time)
        self._observed += 1
        self._changes += 1

    def observe_shadow(self, seq_id: int, drafter: str, proposal: Sequence[int], committed: Sequence[int],
                       k: int, greedy: bool = True, verifier: str | None = None,
                       count_hit: bool = True) -> None:
        """Free evidence for a model-free drafter the row did not run: what it would have
        proposed (asked for k tokens before the cycle) against what the target committed, or
        (greedy, `verifier` a model drafter of the cycle) against that model's own proposals,
        which is exactly how it would have judged them. `count_hit=False` when the same
        proposal was already counted as a hit or miss."""
        cfg = self.config
        req = self._request(seq_id, greedy)
        hit = len(proposal) > 0
        if count_hit:
            self.similarity.observe_hits(drafter, int(hit), 1)
            req.observe_hit(drafter, hit, cfg.request_hit_decay)
            self._note_hit(req, drafter)
        pair = (drafter, verifier or self.target)
        if pair not in self._pair_chains:
            return
        a, rej = shadow_match(proposal, committed, k)
        mode = GREEDY if greedy else SAMPLING
        if a + rej:
            self.similarity.observe_acceptance(pair, mode, a, rej)
            req.observe(pair, a, rej, cfg.request_decay)
            self._note_alpha(req, pair, mode)
        else:
            self.similarity.touch(pair, mode)

    def release(self, seq_id: int) -> None:
        """Forget a finished request, remembering the alphas it reached on its own evidence
        (pairs with >= 4 trials) for new requests' priors."""
        req = self.requests.pop(seq_id, None)
        if req is not None and self.config.request_prior_quantile is not None:
            self.finished.record(req, GREEDY if req.greedy else SAMPLING, skip=self.model_free)
            self._changes += 1  # the priors' quantile may have moved

    def plan_table(self, row: RowContext) -> PlanTable:
        """The PlanTable of a row now (display: `PlanTable.format()`)."""
        return self.evaluate(row, self.requests.get(row.seq_id))[0]

    def _forwards_from_stats(self, stats: CycleStats, rows: Sequence[RowOutcome]) -> list[ForwardRecord]:
        """Approximate forward shapes from CycleStats: a draft model ran k one-token steps, a
        model-free drafter one proposal of k, a verifier at level j one forward of max
        candidates + 1 tokens per row."""
        chain, b = tuple(stats.chain), max(stats.rows, 1)
        L = int(sum(r.context_len for r in rows) / len(rows))
        out = []
        for j, name in enumerate(chain):
            seconds = stats.forward_time.get(name)
            if seconds is None:
                continue
            if j == 0 and len(chain) > 1:
                k = max(stats.k, 1)
                shape = (k, 1) if name in self.model_free else (1, k)  # (new tokens, count)
                out.append(ForwardRecord(name, b, shape[0], L, seconds, shape[1]))
                continue
            widest = max(int(r.drafted[j]) for r in rows) + 1 if j < len(rows[0].drafted) else 1
            per_row = math.ceil(stats.forward_tokens.get(name, b) / b)
            out.append(ForwardRecord(name, b, max(widest, per_row), L, seconds))
        return out
