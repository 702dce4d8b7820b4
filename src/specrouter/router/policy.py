"""The router: per request, every cycle, the chain and draft length of least predicted T_eff
(docs/design.md, Pillar 1), with hysteresis, bounded probing and a log of every decision.

Inputs: a `CostProfile` (T_M(b, t, L)), a `SimilarityEstimator` (alpha per pair and mode), the
pool order (cheapest first, target last) and the names of model-free drafters.

1. `decide(RowContext)`: build each model's cost row T_M(b, ., L) for the row's batch size b and
   context length L, each pair's alpha for this request, the model-free drafters' hit rates, and
   evaluate every sub-chain ending at the target (2^(p-1), (target,) included) for k = 1..k_max
   with `cost_model.best_plan`. The per-cycle overheads are charged on top: the executor's own
   (cycle wall time minus forward time) and the step's outside the executor (the router's
   planning and observing, tree shapes, shadow proposals: router/host_time.py, measured between
   consecutive plan_batch calls), each learned separately for plain and speculative cycles.
   A row with logits
   processors pays their measured seconds per row-forward on every forward it takes part in
   (`cost_model.processor_costs`, learned from the executor's `processor_seconds`).
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
   than `persist_margin` falls back to it at once ("fallback"). Wherever plain decoding is
   weighed against speculation (the argmin, and these rules when the current plan or the best
   is plain), each carries its kind's measured host seconds outside the executor per cycle
   (router/host_time.py `PlainCharge`), not only decide()'s.
3. Probing (router/probing.py, `Prober`): pairs with little (or faded) evidence get their
   optimistic alpha; within a budget (5% of row-cycles, 2% of wall time) a chain measuring one
   of them runs this one cycle when it could beat the plan in that optimistic world; a probe
   whose trials refuted that optimism keeps its pair from the request's probes for a while.
4. `observe_step(StepReport)`, once per engine step: acceptance trials (global and per
   request), D_TV, hit rates, shadow proposals, forward timings into the profile, step
   overheads, the batch calibration. A step of a single stream's firm hold is queued and
   folded where the evidence is next read (router/deferred.py).
5. The decision cache (router/evidence.py, `EvidenceBoard`): decide() reads the evidence as
   published, which changes only when the live estimates move materially (or a model fails or
   slows down), and step 1 (the PlanTable, the expensive part) is reused per row while its key
   holds: the same batch size, context bucket, chain and evidence versions (the table spans
   every k; a row's k cap only limits its argmin). Steps 2-3 run every call.

The engine sees the router through `RouterProtocol` (router/protocol.py): `plan_batch` (the
step's batch, router/batch.py `BatchPlanner`, which owns the plain hold, the batch calibration
and the timing of its own planning; a single stream's kept speculative plan is held without
decide() by router/stream_hold.py `StreamHolder`), `take_confident_drafts`, `observe_step`,
`finish_request`, `mark_failed`.

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
from specrouter.router.batch import BatchPlanner
from specrouter.router.catch_up import stream_catch_ups
from specrouter.router.deferred import Deferral
from specrouter.router.cost_model import (
    break_even_confidence,
    chain_rows,
    enumerate_chains,
    processor_costs,
    with_certain,
)
from specrouter.router.evidence import CachedPlans, CacheStats, EvidenceBoard, certain_bucket, decision_key, TvSchedule
from specrouter.router.host_time import OutsideClock, PlainCharge
from specrouter.router.plan_table import PlanTable
from specrouter.router.probing import Prober
from specrouter.router.profile import CostProfile
from specrouter.records.routing import (  # noqa: F401  (re-exported: the router's public boundary)
    BatchPlan,
    Chain,
    Decision,
    DecisionEvent,
    ForwardRecord,
    Plan,
    RowContext,
    RowOutcome,
    ShadowProposal,
    StepReport,
    widened,
)
from specrouter.router.request_state import FinishedRequests, RequestState
from specrouter.router.stream_hold import StreamHolder
from specrouter.router.similarity import (
    GREEDY,
    SAMPLING,
    Pair,
    SimilarityEstimator,
    acceptance_trials,
    shadow_match,
    shrink,
)


def plan_at(chains: Sequence[Chain], i: int, j: int) -> Plan:
    """The plan at cell (i, j) of a PlanTable (k = j + 1; 0 for the target-only chain)."""
    chain = chains[i]
    return chain, (0 if len(chain) == 1 else j + 1)


def viable(chain: Chain, hits: Mapping[str, float], alphas, model_free: Collection[str], prune_below: float) -> bool:
    """False for a chain that cannot beat plain decoding: a pair that (almost) never accepts,
    or a model-free drafter that (almost) never proposes (`hits`: its hit rate). Pruning them
    makes decide() cheap exactly when speculation is useless."""
    if chain[0] in model_free and hits[chain[0]] < prune_below:
        return False
    return all(alphas[p] >= prune_below for p in zip(chain[:-1], chain[1:]))


def chain_key(i: int, chain: Chain, hits: Mapping[str, float], alphas: Mapping) -> tuple:
    """What row i (`chain`) of a PlanTable reads besides the costs and overheads: its pairs'
    alphas, its confirmed-token alpha, its model-free drafter's hit rate."""
    return (i, *(alphas[p] for p in zip(chain[:-1], chain[1:])),
            alphas.get(chain[:3]) if len(chain) >= 3 else None, hits.get(chain[0]))


def corrected(table: PlanTable, chain_index: Mapping[Chain, int], corrections: Mapping[Chain, float]) -> PlanTable:
    """Step 1b, the realized check: each chain a request ran has its predicted seconds per token
    scaled by realized / predicted there (its expected tokens by the inverse: the same latency,
    fewer or more tokens). A chain that keeps under-delivering (a model-free drafter that rarely
    proposes in open text, a draft accepted less than its pair's estimate) gives way to the
    alternatives, whatever the cause; one that over-delivers keeps its place."""
    if not corrections:
        return table
    t, tokens = table.t_eff.copy(), table.expected_tokens.copy()
    for chain, c in corrections.items():
        i = chain_index.get(chain)
        if i is not None:
            t[i] *= c
            tokens[i] /= c
    return dataclasses.replace(table, t_eff=t, expected_tokens=tokens)


def confirmed_trials(candidates: int, accepted: int, confirmed: int) -> tuple[int, int]:
    """(accepted, rejections) of level 3's confirmed tokens (cost_model.py, point 4): of the
    `candidates` that reached it, the first `confirmed` (the first level's candidates the middle
    accepted), of which it accepted `accepted` in order."""
    c = min(confirmed, candidates)
    return min(accepted, c), int(accepted < c)


def below_target(outcome: RowOutcome | None, model: str | None, target: str) -> tuple[int, int] | None:
    """(candidates, accepted) of the target's level in a row whose chain has `model` directly
    below the target; None otherwise."""
    if outcome is None or model is None or model not in outcome.chain:
        return None
    i = tuple(outcome.chain).index(model)
    if i + 2 != len(outcome.chain) or outcome.chain[-1] != target:
        return None
    return int(outcome.drafted[i + 1]), int(outcome.accepted[i + 1])


def observe_trials(router: "Router", req: RequestState, key: tuple[str, ...], mode: str, accepted: int,
                   rejections: int, sim: float | None = None) -> None:
    """Acceptance trials of a pair (or a triple) for the global estimate and the request's, its
    evidence version noted; a pair that ran without a trial is touched (not stale)."""
    if accepted + rejections:
        router.similarity.observe_acceptance(key, mode, accepted, rejections, sim)
        req.observe(key, accepted, rejections, router.config.request_decay)
        req.note(key, mode)
    else:
        router.similarity.touch(key, mode)


def fade_idle(router: "Router", req: RequestState, chain: Chain, mode: str) -> None:
    """A cycle of `req` ran `chain`: its own evidence of every model pair the chain did not run
    fades by `RouterConfig.request_idle_decay` (toward its prior, republished when that moved its
    alpha materially). A draft's agreement comes in runs (prose greedy on Sapphire Rapids: 15
    agreeing tokens, then 20 of none), and a request whose draft was refuted by its first two
    cycles decoded plainly to its end: nothing it ran tried the draft again, so nothing moved its
    estimate. Model-free drafters' pairs are left: shadow proposals score them on plain cycles."""
    ran = set(zip(chain[:-1], chain[1:]))
    decay = router.config.request_idle_decay
    for pair in req.counts.keys() | req.tv.keys():
        if len(pair) == 2 and pair not in ran and pair[0] not in router.model_free and req.fade(pair, decay):
            req.note(pair, mode)


def observe_forwards(router: "Router", forwards: Sequence[ForwardRecord]) -> None:
    """A step's forwards: each model seen now (the prober's staleness), their timings into the
    cost profile, one at a time (a model-free drafter's batched was `free_timing_batch`,
    removed by prune22)."""
    now = router.similarity.now
    for f in forwards:
        router.prober.model_seen[f.model] = now
        if f.model in router.profile:
            router.profile.observe(f.model, f.rows, f.new_tokens, f.context_len, f.seconds, f.count)


def fold_step(router: "Router", report: StepReport) -> None:
    """One engine step's observation (`Router.observe_step`), after the step clock's pairing:
    the batch calibration, every row's outcome, every forward's timing, the step's overheads,
    the clocks, the shadow proposals."""
    router.planner.observe(report.outcomes, report.forwards, report.wall_time - report.processor_seconds)
    router._observe_rows(report.outcomes, report.wall_time)
    observe_forwards(router, report.forwards)
    router._observe_overhead(report)
    router._observe_processors(report)
    router.similarity.tick(len(report.outcomes))
    router.prober.budget.tick(len(report.outcomes), report.wall_time)
    router.observed_steps += 1
    router.board.changed()
    rows = {o.seq_id: o for o in report.outcomes} if router.triples else {}
    for s in report.shadow:
        router.observe_shadow(s.seq_id, s.drafter, s.proposal, s.judged_by, s.k, s.greedy, s.verifier,
                              s.count_hit, below_target(rows.get(s.seq_id), s.verifier, router.target))


# ---------------------------------------------------------------------------------------------
# the router


class Router:
    """Chooses (chain, k) per request per cycle; see the module docstring. Implements
    `RouterProtocol` (router/protocol.py)."""

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
        step_clock: Callable[[], float] | None = None,
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
        self.measure_tv = self.similarity.config.measure_tv  # RouterProtocol: the executor measures D_TV (this step)
        self.tv_positions = self.similarity.config.tv_positions  # ... at this many candidates per level
        self.on_decision = on_decision
        self.timer = timer  # measures decide() (real time, also under a virtual clock)
        # the clock of the steps' wall times (perf_counter, as `from_pool` sets it; an Engine
        # running this router replaces it with its busy clock, RouterProtocol.step_clock):
        # measures a step's host seconds outside the executor; None: not measured (a simulated
        # pool reports virtual seconds)
        self.step_clock = step_clock
        self.chains: list[Chain] = [
            c for c in enumerate_chains(self.order, target, cfg.max_levels)
            if not any(m in self.first_only for m in c[1:])
        ]
        self.chain_index = {c: i for i, c in enumerate(self.chains)}
        self._chains_tuple = tuple(self.chains)
        self._ks = np.arange(1, cfg.k_max + 1)
        # what `table` reads of each chain to prune it: (chain, its pairs, drafted model-free)
        self._chain_reads = [(c, tuple(zip(c[:-1], c[1:])), c[0] in self.model_free) for c in self.chains]
        self.pairs: list[Pair] = sorted({p for c in self.chains for p in zip(c[:-1], c[1:])},
                                        key=lambda p: (self.order.index(p[0]), self.order.index(p[1])))
        self.pair_chains = {p: [i for i, c in enumerate(self.chains) if p in zip(c[:-1], c[1:])]
                            for p in self.pairs}  # chains that measure the pair
        # model drafts straight below the target (router/catch_up.py: caught up for their evidence)
        self.target_drafts = frozenset(m for m, v in self.pairs if v == target and m not in self.first_only)
        # (first, middle, verifier) of the chains of >= 3 levels drafted by a model-free drafter:
        # level 3's acceptance of confirmed tokens (cost_model.py, point 4), estimated apart
        # (besides the pair's, which counts every token)
        self.triples: list[tuple[str, str, str]] = sorted({c[:3] for c in self.chains
                                                           if len(c) >= 3 and c[0] in self.model_free},
                                                          key=lambda t: [self.order.index(m) for m in t])
        self.requests: dict[int, RequestState] = {}
        self.events: deque[DecisionEvent] = deque(maxlen=cfg.log_size)
        # host seconds outside forwards: per plain step, per speculative cycle (its draft steps'
        # share apart), per model draft step after a drafter's first forward; "processor": per
        # row-forward of a row with logits processors (charged to such rows' forwards, `inputs`)
        # "outside_plain", "outside_spec": per engine step of a single stream, its host seconds
        # outside the executor (router/host_time.py: measured from one plan_batch to the next)
        self.overhead = {"plain": 0.0, "spec": 0.0, "draft_step": 0.0, "processor": 0.0,
                         "outside_plain": 0.0, "outside_spec": 0.0, "outside_spec_held": 0.0}
        self.outside = OutsideClock()  # measures "outside_plain" / "outside_spec"
        self.decide_seconds = 0.0  # EMA of decide() wall time
        self.t_width = cfg.k_max + cfg.max_levels + 2  # cost rows' widths (tokens per forward)
        self.dp_width = cfg.k_max + max(len(c) for c in self.chains)  # best_plan's length axis, any subset
        # the alphas finished requests reached on their own, and their quantile (request_prior)
        self.finished = FinishedRequests(cfg.request_history, cfg.request_prior_quantile,
                                         cfg.request_min_trials, cfg.request_min_finished)
        self.failed: set[str] = set()  # models out of service (mark_failed)
        self.cache_stats = CacheStats()
        self.observed_steps = 0  # engine steps observed (the clock of the plain hold)
        self.board = EvidenceBoard(self)  # published evidence, decision cache (evidence.py)
        sc = self.similarity.config  # the steps that measure D_TV (evidence.py)
        self.tv_schedule = TvSchedule(sc.measure_tv, sc.tv_every, sc.tv_first_cycles)
        self.prober = Prober(self)  # step 3 (probing.py)
        self.planner = BatchPlanner(self)  # the step's batch (batch.py)
        self.stream = StreamHolder(self)  # a single stream's kept speculative plan (stream_hold.py)
        self.deferral = Deferral(self, fold_step)  # observations folded when read (deferred.py)

    @classmethod
    def from_pool(cls, pool, profile: CostProfile, **kwargs) -> "Router":
        """A router over a `Pool` (its order, target, model sizes and model-free drafters)."""
        sizes = {n: int(r.num_params) for n, r in pool.runners.items()}
        packed = {n for n, r in pool.runners.items() if r.packs_ragged}
        kwargs.setdefault("step_clock", time.perf_counter)  # the executor's clock
        return cls(pool.order, pool.target, profile, model_free=set(pool.drafters),
                   first_only=set(pool.heads), packed=packed, sizes=sizes, **kwargs)

    # -- RouterProtocol ---------------------------------------------------------------------
    def plan_batch(self, rows: Sequence[RowContext], pinned: Sequence[Plan] = ()) -> BatchPlan:
        """The plans of a step's rows, chosen for the batch the step really runs
        (`BatchPlanner.plan`), with the model drafts a single stream catches up for their
        evidence (router/catch_up.py)."""
        hold = self.stream.hold
        if self.deferral.queue and not (hold is not None and hold.firm):
            self.deferral.fold()  # the step reads the evidence (deferred.py)
        self.measure_tv = self.tv_schedule.wants(rows, self.requests)  # the step measures D_TV
        measured = None if self.step_clock is None else self.outside.planning(
            self.step_clock(), self.observed_steps, rows, pinned)
        # the last step's host seconds outside the executor, a single stream's the router plans
        # (not a pinned chain's): a batch's are weighed by the batch planner's calibration (its
        # steps' realised seconds, planning included). Plain decoding's are its held steps'
        # (a settled plain stream is held, and a decided plain step, a stream leaving
        # speculation, pays decide() as a speculative one does; `outside_plain_held=False`, every
        # plain step's, removed in session 23, issue 27)
        key = None if measured is None or len(rows) != 1 or pinned else (
            "outside_spec" if measured[1] else "outside_plain" if measured[2] else None)
        # a held speculative step's apart (what a speculating stream pays between its
        # decisions, as plain decoding is priced at its held steps: host_time.PlainCharge)
        for k in (key, "outside_spec_held" if key == "outside_spec" and measured[2] else None):
            if k is not None:
                last = self.overhead[k]  # 0.0: the first measurement (an EMA from 0 would under-charge ~20 steps)
                self.overhead[k] = last + self.config.overhead_alpha * (measured[0] - last) if last else measured[0]
        seq = rows[0].seq_id if len(rows) == 1 else None
        batch = self.stream.plan(rows, pinned, self.requests.get(seq), self.prober.due(), self.profile.jumps,
                                 self.observed_steps) if self.stream.hold is not None else None
        if batch is not None:  # a single stream's kept plan (stream_hold.py): no decide
            self.outside.held()  # a held plain step is what plain decoding costs (outside_plain)
        else:
            if self.deferral.queue:
                self.deferral.fold()  # a firm hold ended: its steps' evidence before the decision
            held = self.planner.held_decisions
            batch = self.planner.plan(rows, pinned)
            if self.planner.held_decisions > held:  # a hold planned the step: no decide
                self.outside.held()
            elif seq is not None and self.stream.keep(rows, pinned, batch.decisions[0], self.requests.get(seq),
                                                      self.observed_steps):
                batch = dataclasses.replace(batch, shadow_k=0)  # a firm hold's last step runs them
        catch = stream_catch_ups(rows, [d.chain for d in batch.decisions], len(pinned), self.config.catch_up_every,
                                 self.target_drafts, self.failed)
        if catch:  # a single stream's draft's evidence while it decodes without it (router/catch_up.py)
            batch = dataclasses.replace(batch, catch_up=catch)
        return batch

    def take_confident_drafts(self, rows: Sequence[RowContext], plans: list[Plan],
                              offers: Mapping[int, tuple[str, int, float]],
                              pinned: Sequence[Plan] = ()) -> list[Plan]:
        """Rows whose model-free drafter offers a confident draft now run it when the step
        gains (`BatchPlanner.take_confident_drafts`)."""
        self.deferral.fold()
        return self.planner.take_confident_drafts(rows, plans, dict(offers), pinned)

    def observe_step(self, report: StepReport) -> None:
        """Learn from one engine step: every row's outcome, every forward's timing, the step's
        overhead, the batch calibration, the shadow proposals (`fold_step`); a firm hold's step
        queued and folded where next read (router/deferred.py)."""
        if self.stream.firm_step(report):
            self.deferral.defer(report)
            return
        if self.deferral.queue:  # a firm hold's steps before this one, in order
            self.deferral.fold()
        self.outside.observed(self.observed_steps, report.wall_time, report.speculative,
                              widened(report.outcomes, report.forwards))
        fold_step(self, report)

    def finish_request(self, seq_id: int) -> None:
        """Forget a finished request, remembering the alphas it reached on its own evidence
        (pairs with >= 4 trials) for new requests' priors."""
        self.deferral.fold()
        req = self.requests.pop(seq_id, None)
        self.prober.testing.pop(seq_id, None)
        if req is not None:
            self.finished.record(req, GREEDY if req.greedy else SAMPLING, skip=self.model_free)
            self.board.changed()  # the priors' quantile may have moved

    def mark_failed(self, model: str) -> None:
        """`model` is out of service (engine/faults.py): no plan uses it from now on, and every
        cached decision is dropped at once (the evidence is republished)."""
        self.deferral.fold()
        if model != self.target and model not in self.failed:
            self.failed.add(model)
            self.stream.release()
            self.board.changed()

    # -- estimates --------------------------------------------------------------------------
    def request(self, seq_id: int, greedy: bool) -> RequestState:
        """The router's memory of a request (created at its first decision or observation)."""
        req = self.requests.get(seq_id)
        if req is None:
            req = self.requests[seq_id] = RequestState(greedy=greedy)
        return req

    def alpha(self, pair: Pair, mode: str, req: RequestState | None = None) -> float:
        """The acceptance estimate of a pair for a request (global when req is None). A triple
        (first, middle, verifier): the acceptance of confirmed tokens (cost_model.py, point 4),
        for a request its own counts shrunk toward its own alpha of (middle, verifier) moved by
        the global lift (global triple - global pair)."""
        glob = self.similarity.alpha(pair, mode)
        if req is None:
            return glob
        if len(pair) == 3:
            lift = glob - self.similarity.alpha(pair[1:], mode)
            prior = min(1.0, max(0.0, self.alpha(pair[1:], mode, req) + lift))
            c = req.counts.get(pair)
            return prior if c is None else shrink(c[0], c[0] + c[1], prior, self.config.request_prior_strength)
        prior = self.request_prior(pair, mode, glob)
        own = req.sim_score(pair)
        if own is not None:  # its own similarity, through the mode's calibration
            w = min(self.config.request_tv_cap, self.config.request_tv_weight * own[1])
            prior = shrink(w * self.similarity.calibrate(own[0], mode), w, prior,
                           self.config.request_prior_strength)
        c = req.counts.get(pair)
        if c is None:
            return prior
        return shrink(c[0], c[0] + c[1], prior, self.config.request_prior_strength)

    def request_prior(self, pair: Pair, mode: str, glob: float | None = None) -> float:
        """A request's prior alpha for a pair (module docstring): max(global, the quantile of
        finished requests' own alphas); the global alpha for model-free drafters and before 3
        finished requests."""
        glob = self.similarity.alpha(pair, mode) if glob is None else glob
        if pair[0] in self.model_free:
            return glob
        edge = self.finished.quantile(pair, mode)
        return glob if edge is None else max(glob, edge)

    def hit_rate(self, drafter: str, req: RequestState | None = None) -> float:
        glob = self.similarity.hit_rate(drafter)
        h = req.hits.get(drafter) if req is not None else None
        if h is None:
            return glob
        return shrink(h[0], h[1], glob, self.config.request_hit_prior_strength)

    def inputs(self, row: RowContext, req: RequestState | None):
        """(costs, alphas, router seconds per cycle) of a row for best_plan, from the published
        evidence (evidence.py)."""
        mode = GREEDY if row.greedy else SAMPLING
        published = self.board.current()
        rows = self.board.cost_rows(max(row.batch_size, 1), max(row.context_len, 1), self.t_width)
        evidence = self.board.request_evidence(req, mode)
        costs: dict[str, object] = dict(rows)
        if row.processors and published.times["processor"] > 0.0:
            costs.update(processor_costs(rows, published.times["processor"], self.model_free))
        rate = certain_bucket(row.certain_rate)
        if rate:  # grammar-forced certain drafts widen the verifying forwards (cost_model.with_certain)
            costs.update(with_certain({m: costs[m] for m in rows if m not in self.model_free}, rate))
        for d in self.model_free:
            costs[d] = self.board.free_draft(rows, d, evidence.hits[d])
        # a speculative cycle's host seconds outside the executor as the table charges them
        # (table() charges a plain one's): decide()'s per row (the measured ones, charged to every
        # plan, were `charge_outside`: off, removed by prune22; host_time.py `PlainCharge`)
        outside = published.times["router"] * max(row.batch_size, 1)
        return costs, dict(evidence.alphas), outside

    def table(self, costs, alphas, router: float, k_cap: int, keep: int | None = None,
              prune: bool = True, rows: dict | None = None, only: Collection[int] | None = None) -> PlanTable:
        """best_plan over the viable chains (and `keep`), with every overhead, as a PlanTable over
        all chains: t_eff (C, K) is +inf and the expectations NaN for pruned ones and for those
        with a failed model. `router`: a speculative cycle's host seconds outside the executor
        (`inputs`); a plain cycle's are the published ones. `rows`: the chains' (latency,
        tokens) rows already evaluated on these costs and overheads (`EvidenceBoard.chain_rows`),
        keyed by `chain_key`; only the others are evaluated (and added). `only`: the chains
        evaluated besides plain decoding (the others +inf, as pruned ones)."""
        published = self.board.current()
        cfg = self.config
        hits = {d: costs[d].hit_rate for d in self.model_free}
        failed, lo = published.failed, cfg.prune_below
        idx = [0]  # chains[0] is (target,)
        for i, (chain, pairs, free) in enumerate(self._chain_reads[1:], start=1):
            if (only is not None and i not in only) or (failed and not failed.isdisjoint(chain)):
                continue
            if prune and i != keep and ((free and hits[chain[0]] < lo) or any(alphas[p] < lo for p in pairs)):
                continue  # not viable
            idx.append(i)
        shape = (len(self.chains), cfg.k_max)
        latency, tokens = np.full(shape, np.nan), np.full(shape, np.nan)
        todo = idx
        if rows is not None:
            keys = [chain_key(i, self.chains[i], hits, alphas) for i in idx]
            got = [rows.get(key) for key in keys]
            todo = [i for i, g in zip(idx, got) if g is None]
        if todo:
            # always k = 1..k_max, cut to k_cap: a column's values do not depend on the cap
            # (CachedPlans.best), and computed alike whatever the cap or the subset of chains
            # (one DP width for all) they are equal bit for bit
            lat, tok = chain_rows([self.chains[i] for i in todo], cfg.k_max, costs=costs,
                                  alphas=alphas, overhead=published.times["spec"] + router,
                                  draft_step_overhead=published.times["draft_step"],
                                  min_width=self.dp_width, prepared=rows)
            latency[todo], tokens[todo] = lat, tok
        if rows is not None:
            new = iter(range(len(todo)))
            for i, key, g in zip(idx, keys, got):
                if g is not None:
                    latency[i], tokens[i] = g
                else:  # views of chain_rows' own arrays, which nothing else keeps or writes
                    r = next(new)
                    rows[key] = (lat[r], tok[r])
        t = latency / tokens  # as best_plan's t_eff, element by element (NaN where not evaluated)
        if len(idx) < len(self.chains):
            t[np.isnan(t)] = np.inf
        plain = published.times["plain"] + router
        t[0] += plain  # chains[0] is (target,): one token per cycle
        latency[0] += plain
        if k_cap < cfg.k_max:
            t, tokens, latency = t[:, :k_cap], tokens[:, :k_cap], latency[:, :k_cap]
        return PlanTable(chains=self._chains_tuple, ks=self._ks[:k_cap], t_eff=t, expected_tokens=tokens,
                         expected_latency=latency)

    def evaluate(self, row: RowContext, req: RequestState | None = None, k_cap: int | None = None,
                 prune: bool = False) -> tuple[PlanTable, dict[Pair, float]]:
        """(PlanTable with all overheads, alphas) of a row: what decide() takes the argmin of,
        for display (`specrouter profile`) and tests."""
        costs, alphas, router = self.inputs(row, req)
        k_cap = self.config.k_max if k_cap is None else k_cap
        return self.table(costs, alphas, router, k_cap, prune=prune), alphas

    def plan_table(self, row: RowContext) -> PlanTable:
        """The PlanTable of a row now (display: `PlanTable.format()`)."""
        return self.evaluate(row, self.requests.get(row.seq_id))[0]

    # -- deciding ---------------------------------------------------------------------------
    def decide(self, row: RowContext) -> Decision:
        """The (chain, k) this row runs next cycle (module docstring, steps 1-3); step 1 (the
        PlanTable) is reused while the row's decision key holds (router/evidence.py)."""
        if self.deferral.queue:  # a caller outside plan_batch (which folds first): read what was observed
            self.deferral.fold()
        t0 = self.timer()
        cfg = self.config
        req = self.request(row.seq_id, row.greedy)
        req.settle(self.board)  # its estimates noted since its last decision
        mode = GREEDY if row.greedy else SAMPLING
        if mode not in self.board.modes:
            self.board.modes.add(mode)
            self.board.changed()  # its priors are watched from now on
        k_cap = cfg.k_max if row.remaining is None else min(cfg.k_max, row.remaining - 1)
        prev = req.plan
        plain = (self.target,)
        if k_cap < 1 or len(self.chains) == 1:
            t_plain = float(self.board.cost_rows(max(row.batch_size, 1), max(row.context_len, 1),
                                                 self.t_width)[self.target][1])
            req.plan, req.worse, req.table, req.pending = (plain, 0), 0, None, None
            decision = Decision(plain, 0, t_plain, "end" if k_cap < 1 else "only")
            return self._log(row, req, mode, decision, prev, (plain, 0), t_plain, t_plain, {}, t0)
        version = self.board.current().version
        evidence = self.board.request_evidence(req, mode)  # published for this key (the log and note_alpha read it)
        # the request's chain is evaluated even where pruning would drop it (`_plans`), so it is
        # part of the key only then: a viable chain is in the table whatever the request runs,
        # and a switch between viable chains keeps the table (a third of the misses, simulated)
        kept = req.plan[0] if req.plan is not None else None
        if kept is not None and viable(kept, evidence.hits, evidence.alphas, self.model_free, cfg.prune_below):
            kept = None
        key = decision_key(max(row.batch_size, 1), max(row.context_len, 1) // cfg.context_bucket,
                           mode, kept, version, req.version, certain_bucket(row.certain_rate))
        plans = req.cached
        if plans is not None and plans.key == key:
            self.cache_stats.hits += 1
        else:
            self.cache_stats.miss(plans.key if plans is not None else None, key)
            plans = req.cached = self._plans(row, req, key)
        decision = self._hysteresis(req, plans, k_cap)
        if self.prober.due():
            decision = self.prober.decide(row, req, mode, k_cap, decision, plans)
        # what the realized check compares the cycle with: the model's prediction (probes are
        # predicted without the correction, planned cycles with it)
        applied = 1.0 if decision.reason == "probe" else req.corrections.get(decision.chain, 1.0)
        req.pending = (decision.chain, decision.t_eff / applied)
        best, t_best = plans.best(k_cap)
        return self._log(row, req, mode, decision, prev, best, t_best, plans.t_plain, req.evidence.alphas, t0)

    def _plans(self, row: RowContext, req: RequestState, key: tuple) -> CachedPlans:
        """Step 1: the row's PlanTable over k = 1..k_max (keeping the request's chain)."""
        prev = req.plan
        costs, alphas, router = self.inputs(row, req)
        cfg = self.config
        keep = self.chain_index.get(prev[0]) if prev is not None else None
        times = self.board.current().times
        rows = self.board.rows_for(row, router)  # the chains whose estimates did not move keep their rows
        table = corrected(self.table(costs, alphas, router, cfg.k_max, keep=keep, rows=rows),
                          self.chain_index, req.corrections)
        # a single stream's (a batch's plain-vs-speculate choice is the batch planner's)
        charge = PlainCharge.measured(times, router) if row.batch_size <= 1 else PlainCharge()
        return CachedPlans(key, table, costs, float(table.t_eff[0, 0]), charge, alphas, router)

    def _hysteresis(self, req: RequestState, plans: CachedPlans, k_cap: int) -> Decision:
        """Step 2: keep the request's plan unless the best is enough faster (module docstring);
        updates the request's plan, hysteresis counter and epoch."""
        cfg = self.config
        (best, t_best), prev, t = plans.best(k_cap), req.plan, plans.table.t_eff
        plain = (self.target,)
        jumps = self.profile.jumps
        ci = self.chain_index.get(prev[0]) if prev is not None else None
        if prev is None:
            choice, reason = best, "initial"
        elif ci is None:
            choice, reason = best, "invalid"
        else:
            cj = 0 if len(prev[0]) == 1 else min(prev[1], k_cap) - 1
            current = plan_at(self.chains, ci, cj)
            t_cur = float(t[ci, cj])
            if plain in (current[0], best[0]):  # plain against speculation: both with their charge
                t_cur = float(plans.charged[ci, cj])
                t_best = float(plans.charged[self.chain_index[best[0]], max(best[1], 1) - 1])
            changed = tuple(jumps.get(m, 0) for m in prev[0]) != req.epoch  # a model of the plan changed speed
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
        req.plan, req.epoch, req.table = choice, tuple(jumps.get(m, 0) for m in choice[0]), plans.table
        i, j = self.chain_index[choice[0]], max(choice[1], 1) - 1
        t_eff = float(t[i, j])
        floor = plans.floors.get(choice)  # memoized with the plans
        if floor is None:
            floor = plans.floors[choice] = self.confidence_floor(choice[0], choice[1], t_eff, plans.costs)
        return Decision(choice[0], choice[1], t_eff, reason, floor)

    def confidence_floor(self, chain: Chain, k: int, t_eff: float, costs) -> float:
        """Break-even acceptance of one more candidate of a plan whose first level is model-free
        (`cost_model.break_even_confidence`); 0 otherwise."""
        if k < 1 or len(chain) < 2 or chain[0] not in self.model_free:
            return 0.0
        return break_even_confidence([costs[m] for m in chain[1:]], k, t_eff)

    def _log(self, row, req, mode, decision, prev, best, t_best, t_plain, alphas, t0) -> Decision:
        elapsed = self.timer() - t0
        a = self.config.overhead_alpha
        self.decide_seconds += a * (elapsed - self.decide_seconds) if self.decide_seconds else elapsed
        published = self.board.published
        if abs(self.decide_seconds - published.times["router"]) > self.config.decision_time_tolerance * published.scale:
            self.board.changed()  # the router's own time moved materially: republish before the next decision
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
    def _observe_rows(self, rows: Sequence[RowOutcome], wall_time: float = 0.0) -> None:
        """Acceptance trials, hit rates and D_TV of every row, per mode (greedy evidence only
        from greedy rows); the realized check of a one-row step."""
        cfg = self.config
        sim = self.similarity
        for r in rows:
            mode = GREEDY if r.greedy else SAMPLING
            req = self.request(r.seq_id, r.greedy)
            if len(rows) == 1:
                self._observe_realized(req, r, wall_time)
            if self.prober.pending:  # a probe's realised extra seconds (one row's step only)
                self.prober.settle(r.seq_id, wall_time if len(rows) == 1 else None,
                                   int(r.accepted[-1]) + 1 if len(r.chain) > 1 else 1)
            if self.prober.testing:  # what a probe's trials showed (its pair's back-off)
                self.prober.judge(req, r)
            req.cycles += 1
            chain = tuple(r.chain)
            if cfg.request_idle_decay < 1.0:
                fade_idle(self, req, chain, mode)
            for j in range(1, len(chain)):
                pair = (chain[j - 1], chain[j])
                cand, acc = int(r.drafted[j]), int(r.accepted[j])
                proposal_len = None
                if j == 1 and chain[0] in self.model_free:
                    hit = int(r.drafted[0]) > 0
                    sim.observe_hits(chain[0], int(hit), 1)
                    req.observe_hit(chain[0], hit, cfg.request_hit_decay)
                    req.note(chain[0])
                    proposal_len = r.k
                tv = float(r.tv[j]) if (r.tv is not None and j < len(r.tv) and r.tv[j] is not None
                                        and not r.greedy) else math.nan
                if math.isfinite(tv):  # the row's own D_TV at its first candidates (decoding/tv.py)
                    measured = min(cand, self.tv_positions)
                    sim.observe_tv(pair, mode, tv, measured)
                    req.observe_tv(pair, tv, measured, cfg.request_decay)
                a, rej = acceptance_trials(cand, acc, proposal_len)
                observe_trials(self, req, pair, mode, a, rej, 1.0 - tv if math.isfinite(tv) else None)
                if j == 2 and chain[:3] in self.triples:  # and its confirmed tokens (cost_model.py, 4)
                    observe_trials(self, req, chain[:3], mode, *confirmed_trials(cand, acc, int(r.accepted[1])))
            for model, matches, trials in r.caught_up:  # teacher-forced trials (router/catch_up.py)
                if (model, self.target) in self.pair_chains:
                    observe_trials(self, req, (model, self.target), mode, matches, trials - matches)

    def _observe_realized(self, req: RequestState, r: RowOutcome, wall_time: float) -> None:
        """The realized check (step 1b) of chains drafted by a model-free drafter, whose cost
        model is the coarsest (a hit rate times iid acceptance, where a lookup's drafts are all
        or nothing and a confidence-sized one stops at its floor): charge the cycle's seconds
        and committed tokens to the chain decided for it (a drafter that proposed nothing ran a
        plain step, on its account). Not the request's first cycle (its prefill) nor a plan
        another part changed (the batch planner, a confident draft). Every other cycle fades
        the chains' evidence all the same: a chain penalized once, then given up for a model
        draft or plain decoding, is not penalized for the rest of the request (it was: the
        corrections were refreshed only on cycles of such chains)."""
        pending, req.pending = req.pending, None
        chain = tuple(r.chain)
        if pending is None or req.cycles == 0 or not (wall_time > 0.0):
            return
        planned, predicted = pending
        cfg = self.config
        if planned[0] in self.model_free and (chain == planned or len(chain) == 1):
            tokens = 1 if len(chain) == 1 else int(r.accepted[-1]) + 1
            req.observe_realized(planned, wall_time, tokens, predicted, cfg.realized_decay)
        elif req.realized:
            req.fade_realized(cfg.realized_fade)
        else:
            return
        lo, hi = cfg.realized_clip
        for c_chain in req.realized:  # every chain's evidence faded: republish what moved
            c = min(max(req.correction(c_chain, cfg.realized_prior_tokens), lo), hi)
            if abs(c - req.corrections.get(c_chain, 1.0)) > cfg.realized_tolerance:
                req.corrections[c_chain] = c
                req.version += 1  # its decisions read it (router/evidence.py)

    def _observe_processors(self, report: StepReport) -> None:
        """The logits processors' seconds per row-forward (decoding/processors.py runs once per
        forward over its rows' positions: the cost is mostly per call, little per position)."""
        if report.processor_rows:
            per_row = report.processor_seconds / report.processor_rows
            self.overhead["processor"] += self.config.overhead_alpha * (per_row - self.overhead["processor"])

    def _observe_overhead(self, report: StepReport) -> None:
        """The step's host seconds (wall outside forwards and the rows' logits processors,
        charged apart): a plain step's, or a speculative one's split into its draft steps' (per
        step: they grow with k; the executor leaves their processors out too) and the cycle's own."""
        a = self.config.overhead_alpha
        host = max(report.wall_time - report.forward_time - report.processor_seconds, 0.0)
        if not report.speculative:
            self.overhead["plain"] += a * (host - self.overhead["plain"])
            return
        steps = report.draft_host_seconds
        if report.draft_steps > 0:
            per_step = report.draft_host_seconds / report.draft_steps
            self.overhead["draft_step"] += a * (per_step - self.overhead["draft_step"])
        cycle = max(host - steps, 0.0)
        self.overhead["spec"] += a * (cycle - self.overhead["spec"])

    def observe_shadow(self, seq_id: int, drafter: str, proposal: Sequence[int], committed: Sequence[int],
                       k: int, greedy: bool = True, verifier: str | None = None,
                       count_hit: bool = True, target: tuple[int, int] | None = None) -> None:
        """Free evidence for a model-free drafter the row did not run: what it would have
        proposed (asked for k tokens before the cycle) against what the target committed, or
        (`verifier` the row's first model level) against that model's own tokens of the cycle,
        which is exactly how it would have judged them, greedy or sampled (every level samples
        with the same position-keyed noise): the (drafter, draft) pairs of three-level chains
        learn on every cycle the draft runs, not only from probes. `count_hit=False` when the
        same proposal was already counted as a hit or miss. `target`: (candidates, accepted) of
        the target's level when `verifier` sits directly below it (`below_target`): the target's
        judgement of the verifier's tokens the drafter also proposed (confirmed tokens,
        cost_model.py point 4) for the triple (drafter, verifier, target)."""
        cfg = self.config
        req = self.request(seq_id, greedy)
        hit = len(proposal) > 0
        if count_hit:
            self.similarity.observe_hits(drafter, int(hit), 1)
            req.observe_hit(drafter, hit, cfg.request_hit_decay)
            req.note(drafter)
        pair = (drafter, verifier or self.target)
        if pair not in self.pair_chains:
            return
        a, rej = shadow_match(proposal, committed, k)
        mode = GREEDY if greedy else SAMPLING
        observe_trials(self, req, pair, mode, a, rej)
        triple = (drafter, verifier, self.target)
        if target is not None and a > 0 and triple in self.triples:
            m = min(a, target[0])  # the confirmed tokens among those that reached the target
            observe_trials(self, req, triple, mode, min(target[1], m), int(target[1] < m))
