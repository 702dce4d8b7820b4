"""A single stream's speculative hold (issue 31): its settled speculative plan kept for a few
cycles without decide().

A speculating single stream decided every cycle: on the 2-core Zen 1 (avx2 kernels) decide()
took 1.5-2.6 ms of the 3.5-5.7 ms of host time an engine step spends outside the executor, on a
~20 ms target step, and the step's shadow proposals and confident-draft checks ~0.5 ms more;
any speculation committing under ~1.3 tokens a cycle lost to plain decoding on that alone. A
settled plain stream was already held (router/batch.py `PlainHold`), and a multi-row batch's
speculative plans are (`SpecHold`); a single stream's speculative plan now is too.

`StreamHold` starts after decide() and lasts `RouterConfig.stream_hold_steps` engine steps of
that one row, unless released first. Two kinds:

A firm hold (lean18; on since lean20) of a speculative plan: the request's own evidence moved
nearly every cycle (on a t=0.7 single-stream trace 148 of 246 holds released by it were released
most after one step, and 63 more by a probe falling due, of which 14 ran), so a hold released
by it held little. A firm hold starts after every decided speculative plan but a probe or a
request's first (a switch too), lasts its span whatever the request's evidence does, lets a due
probe wait for its end, caps k near the request's end instead of ending, and watches only the
plan's models' speed jumps (a model-free drafter's timing noise fired its step detector ~25
times a run); its shadow proposals run on its last step only (`keep` returns True: the decided
step that starts it has none), and its steps are offered confident drafts as decided ones are
(`BatchPlan.held` False). Its steps' observations are folded when next read (router/deferred.py)
and it is released by its first pair's trials as it counts them (`HoldTrials`: the pair's
estimate, as decisions read it, falling by more than `decision_tolerance` or past the plan's
break-even with plain decoding, `break_even`) and its models' forwards (`watch`), by a row
change, a pinned row, the certain-draft bucket and patience.

A hold of a plain plan kept by hysteresis (speculation predicted faster by less than
`switch_margin`): chat with penalties on a Zen 1 decided such plain steps every step, 8-22 of a
request's ~60, ~2 ms each (a plain plan kept as the best is the batch planner's plain hold). It
is released by what would change the decision:
- the request's evidence version moved (router/evidence.py: its own alpha or hit rate moved
  materially, or the realized check's correction did: a realised/predicted mismatch);
- the profile's step detector fired for a model of the plan (a slowdown or a recovery);
- a probe is due (router/probing.py: the held cycles do not delay exploration);
- the row's certain-draft bucket (grammar-forced drafts) changed;
- another row joins, a pinned row runs beside it, or the row changes (a new request);
- patience runs out: a hold kept by hysteresis while the plan was predicted slower than the
  best by more than `persist_margin` (counting toward `patience`) counts each held cycle as a
  repeat of that decision (while the hold holds, the request's evidence did not move, so deciding
  would have found the same), and ends in time for the decision that switches ("persistent")
  at the same cycle as without the hold.
Held cycles run the decided plan as decided (chain, k, confidence floor), and the realized
check compares each with the prediction it was decided at. A plain hold's shadow proposals run
on its last step only (their evidence is read by the decision that ends it), confident drafts
are not offered (the step is `BatchPlan.held`), and no DecisionEvent is logged
(`StreamHolder.held` counts the held cycles of both kinds). The global evidence published
between (other streams' moves, the refresh) is read when the hold ends, at most
`stream_hold_steps - 1` cycles late.

The "as before" paths were removed by prune23 (issue 27): a speculative hold released by the
request's evidence moving (`RouterConfig.stream_hold_firm` False), a firm hold released by the
tolerance only (`stream_hold_break_even` False) or by the request's folded estimate
(`defer_observations` False), a plain plan kept by hysteresis decided every step
(`stream_hold_plain` False); a firm hold's span doubling (`stream_hold_max`) by prune22."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specrouter.records.routing import BatchPlan, Chain, Decision, Plan, RowContext
from specrouter.router.evidence import certain_bucket, decision_margin, decision_z, own_trials
from specrouter.router.request_state import RequestState
from specrouter.router.similarity import acceptance_trials, decayed_add, shrink


@dataclass(frozen=True)
class StreamHold:
    """One row's plan (speculative: a firm hold; plain: kept by hysteresis), kept until
    observed step `until` (module docstring)."""

    seq_id: int  # the row it was decided for
    decision: Decision  # what every held cycle runs (reason "held")
    pending: tuple[Chain, float] | None  # what the realized check compares a held cycle with (RequestState.pending)
    version: int  # the request's evidence version it was decided at (RequestState.version)
    epoch: tuple[int, ...]  # the profile's step-detector counts of the plan's models then
    certain: float  # the row's certain-draft bucket then (evidence.certain_bucket)
    until: int  # observed step at which the row is decided again
    counts: bool = False  # kept by hysteresis counting toward patience: each held cycle counts too
    firm: bool = False  # a speculative plan's: not released by the request's evidence moving (module docstring)
    # the models whose speed jumps release it (`epoch`: their counts then): the plan's; a firm
    # hold's leaves out model-free drafters (their proposals take tens of microseconds of a
    # ~10 ms step: their step detector fired ~30 times a run, each a decision for nothing)
    watched: tuple[str, ...] | None = None
    # a firm hold's break-even: its first pair's alpha (as decisions read it) below which the plan
    # is predicted no faster than plain decoding (`StreamHolder.break_even`; -inf: none)
    floor: float = -math.inf

    def holds(self, row: RowContext, req: RequestState, jumps: Mapping[str, int], now: int, patience: int) -> bool:
        """Still the same one row, before `until`, its evidence and models' speeds unchanged,
        the plan's k within the row's cap, and (`counts`) the next decision not the one that
        switches for patience (a probe due is the router's to check)."""
        d = self.decision
        return (row.seq_id == self.seq_id and now < self.until and (self.firm or req.version == self.version)
                and (row.remaining is None or row.remaining - 1 >= (1 if self.firm else d.k))
                and tuple(jumps.get(m, 0) for m in (d.chain if self.watched is None else self.watched)) == self.epoch
                and certain_bucket(row.certain_rate) == self.certain
                and not (self.counts and req.worse + 1 >= patience))

    def last_step(self, now: int) -> bool:
        """Is observed step `now` the hold's last (its shadow proposals run)?"""
        return now == self.until - 1


class StreamHolder:
    """The stream hold of one `Router` (module docstring): `plan` plans a step by the hold while
    it holds, `keep` starts one after a decision that keeps a speculative plan."""

    # decisions (policy.py, step 2) that start a hold: of a plain plan, one kept while
    # speculation is predicted faster by less than switch_margin (one kept as the best, "same",
    # is the batch planner's PlainHold, spans growing to plain_hold_max) ...
    PLAIN_KEPT = ("hysteresis",)
    # ... of a speculative plan (a firm hold), every decided one but a probe, whose one cycle
    # measures a pair (the request's first decision is not held)
    FIRM = ("same", "hysteresis", "better", "changed", "persistent")

    def __init__(self, router):
        self.router = router  # policy.Router: its settings (read at every step, as the planner's)
        self.hold: StreamHold | None = None
        self.held = 0  # cycles planned by a hold (no decide, no DecisionEvent)
        # a firm hold's first-pair trials as it counts them (its observations deferred,
        # router/deferred.py): `HoldTrials`
        self.trials: HoldTrials | None = None
        # ... and its models' forwards against the profile's speed then (`watch`): (model, new
        # tokens) -> predicted seconds of one forward; model -> its streak of outliers (+1 slow, -1 fast)
        self.expected: dict[tuple[str, float], float] = {}
        self.streaks: dict[str, int] = {}

    def plan(self, rows: Sequence[RowContext], pinned: Sequence[Plan], req: RequestState | None,
             probe_due: bool, jumps: Mapping[str, int], now: int) -> BatchPlan | None:
        """The step's plan by the hold (`req`: its request's state, None once finished) while
        it holds, else None and the hold is released. A held cycle is compared by the realized
        check with the prediction it was decided at, and counts toward patience as a repeat of
        the decision that kept it (`StreamHold.counts`)."""
        hold = self.hold
        if hold is None:
            return None
        if req is not None and not hold.firm:
            req.settle(self.router.board)  # its version, as the observations since moved it
        if (len(rows) != 1 or pinned or req is None or (probe_due and not hold.firm)
                or not hold.holds(rows[0], req, jumps, now, self.router.config.patience)
                or (hold.firm and self.trials.refuted())):
            self.hold = None
            return None
        req.pending = hold.pending
        req.worse += hold.counts
        self.held += 1
        decision, cap = hold.decision, rows[0].remaining
        if cap is not None and cap - 1 < decision.k:  # a firm hold near the request's end: k capped
            decision = dataclasses.replace(decision, k=cap - 1)
        # a firm hold's steps are offered confident drafts as decided ones are (`BatchPlan.held`
        # False: a greedy row's suffix drafter may offer one, checked every PEEK_BACKOFF steps):
        # held three steps in four, a copied span's long confident draft waited for the decision
        return BatchPlan([decision], not hold.firm, self.router.config.shadow_k if hold.last_step(now) else 0)

    def keep(self, rows: Sequence[RowContext], pinned: Sequence[Plan], decision: Decision,
             req: RequestState | None, now: int) -> bool:
        """After a step planned by decide(): a single stream's decided speculative plan (`FIRM`:
        a firm hold) or plain plan kept by hysteresis (`PLAIN_KEPT`) is held until observed step
        now + `stream_hold_steps`. True when a firm hold started (the step's own shadow proposals
        are left out: the hold's last step runs them, before the decision that reads them)."""
        cfg = self.router.config
        firm = decision.k > 0
        if (len(rows) != 1 or pinned or cfg.stream_hold_steps < 2 or req is None
                or decision.reason not in (self.FIRM if firm else self.PLAIN_KEPT)):
            return False
        watched = tuple(m for m in decision.chain if m not in self.router.model_free) if firm else None
        epoch = req.epoch if not firm else tuple(self.router.profile.jumps.get(m, 0) for m in watched)
        span = cfg.stream_hold_steps
        floor = self.break_even(decision, req) if firm else -math.inf
        self.trials = HoldTrials.start(self.router, decision.chain, req, floor) if firm else None
        self.expected, self.streaks = {}, {}
        self.hold = StreamHold(rows[0].seq_id, dataclasses.replace(decision, reason="held"), req.pending,
                               req.version, epoch, certain_bucket(rows[0].certain_rate),
                               now + span, req.worse > 0, firm, watched, floor)
        return firm

    def break_even(self, decision: Decision, req: RequestState) -> float:
        """The alpha of a firm hold's first pair (a model draft's; as decisions read it) at which
        its plan is predicted as slow as plain decoding less `persist_margin`, where the
        decision would fall back ("fallback", policy.py step 2): the plan's T_eff scaled by its
        expected tokens per cycle at the published alpha over those at a lower one (the iid
        model, 1 + a + ... + a^k; the plan's seconds per cycle held). A fall of the request's
        estimate within `decision_tolerance` but across it releases the hold: near break-even
        a refuted draft ran the rest of its hold (the lock-in's return, lean20); a plan decided
        within `persist_margin` of plain decoding, the published alpha itself (any fall). -inf
        where the plan leads with a model-free drafter, or no table is at hand."""
        router, plans, evidence = self.router, req.cached, req.evidence
        chain, k = decision.chain, decision.k
        ci = router.chain_index.get(chain)
        if plans is None or evidence is None or ci is None or chain[0] in router.model_free or k < 1 \
                or k > plans.charged.shape[1]:
            return -math.inf
        a0 = evidence.alphas.get(chain[:2])
        t_cur, t_plain = float(plans.charged[ci, k - 1]), float(plans.charged[0, 0])
        line = t_plain / (1.0 + router.config.persist_margin)
        if a0 is None or t_cur <= 0.0:
            return -math.inf
        need = expected_tokens(a0, k) * t_cur / line  # tokens a cycle at which T_eff reaches the line
        if need <= 1.0:
            return -math.inf
        if need >= expected_tokens(a0, k):  # decided within persist_margin of plain: any fall releases it
            return a0
        lo, hi = 0.0, a0
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if expected_tokens(mid, k) < need else (lo, mid)
        return hi

    def release(self) -> None:
        """Drop the hold (a model failed: its plan may name it)."""
        self.hold = None

    def firm_step(self, report) -> bool:
        """Is `report` a step of the firm hold now held (its one row)? Its observation is what
        deferral defers (router/deferred.py)."""
        hold = self.hold
        return (hold is not None and hold.firm and len(report.outcomes) == 1
                and report.outcomes[0].seq_id == hold.seq_id)

    def tally(self, report) -> None:
        """A step's report, queued unfolded (router/deferred.py): a firm hold's row's trials of
        its first pair counted (`HoldTrials`)."""
        hold, trials = self.hold, self.trials
        if hold is not None and trials is not None and len(report.outcomes) == 1 \
                and report.outcomes[0].seq_id == hold.seq_id:
            trials.count(report.outcomes[0])
            if not self.watch(hold, report.forwards):
                self.hold = self.trials = None  # released: the next step folds and decides

    def watch(self, hold: StreamHold, forwards) -> bool:
        """A deferred firm hold's models' speeds, as the profile's step detector would read them
        (router/profile.py: `jump_after` forwards in a row off by more than `jump_ratio`, the same
        way): False once one jumped. Folded only at the hold's end, a draft that slowed 5x for
        good ran the rest of an 8-step span (-4.8% in test_router_lock_in's world); each forward
        is compared with the profile's prediction of its shape when the hold first saw it."""
        profile, watched = self.router.profile, hold.watched or ()
        cfg = profile.config
        for f in forwards:
            if f.model not in watched or f.seconds <= 0.0 or f.count < 1:
                continue
            key = (f.model, f.new_tokens)
            expected = self.expected.get(key)
            if expected is None:
                expected = self.expected[key] = profile.predict(f.model, f.rows, f.new_tokens, f.context_len)
            if expected <= 0.0:
                continue
            ratio = f.seconds / f.count / expected
            side = 1 if ratio > cfg.jump_ratio else -1 if ratio * cfg.jump_ratio < 1.0 else 0
            streak = self.streaks.get(f.model, 0)
            streak = 0 if side == 0 else streak + side if streak * side > 0 else side
            self.streaks[f.model] = streak
            if abs(streak) >= cfg.jump_after:
                return False
        return True


def expected_tokens(a: float, k: int) -> float:
    """Tokens a cycle of k iid candidates accepted with probability a commits: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class HoldTrials:
    """A firm hold's release (its observations deferred): the request's own estimate of the
    plan's first pair (and its model-free drafter's hit rate) carried forward from the decision
    by the hold's own trials, as the request's decayed counts take them, over the prior the
    request had then (the global estimate and the request's similarity held where they were).
    Refuted once a trial moved it and it fell below `line`: the published value it was decided
    on less `decision_tolerance` (`decision_hit_tolerance` for the hit rate), or the plan's
    break-even with plain decoding where higher (`StreamHolder.break_even`); like with like,
    less the decision margin (its trials: the counts', the prior's and the SimScore's it had
    then, `own_trials`; review19 R1: the raw estimate against the margined published value had
    to fall by the margin too, 0.12 instead of 0.05 at alpha 0.4 with 4 own trials). Evidence
    that moved for other pairs, or up, does not end it; evidence against the plan does (a
    draft refuted in a request's first cycles ran three more: plain decoding is the safe
    default). The release by the request's folded estimate without deferral was
    `StreamHolder.refuted` (removed with `defer_observations` by prune23, issue 27)."""

    pair: tuple
    free: bool  # the first level is a model-free drafter (its hit rate watched too)
    counts: list  # the request's [accepted, rejections] of the pair, decayed, from the decision on
    prior: float  # the request's prior of the pair then (its estimate without its own counts)
    line: float  # refuted below this (the published alpha less decision_tolerance)
    hits: list  # the request's [hits, proposals] of the drafter, decayed
    hit_prior: float
    hit_line: float
    decay: float
    hit_decay: float
    strength: float
    hit_strength: float
    z: float = 0.0  # the mode's decision margin (evidence.py `decision_z`)
    extra: float = 0.0  # the pair's SimScore pseudo-trials at the decision (`own_trials`), held
    moved: bool = False

    @classmethod
    def start(cls, router, chain, req: RequestState, floor: float = -math.inf) -> "HoldTrials":
        cfg, evidence = router.config, req.evidence
        pair, free = tuple(chain[:2]), chain[0] in router.model_free
        mode = evidence.stamp[2]
        n0, h0 = cfg.request_prior_strength, cfg.request_hit_prior_strength
        c = list(req.counts.get(pair, (0.0, 0.0)))
        live = router.alpha(pair, mode, req)
        prior = (live * (c[0] + c[1] + n0) - c[0]) / n0 if n0 > 0 else live  # shrink's inverse
        published = evidence.alphas.get(pair)
        h = list(req.hits.get(chain[0], (0.0, 0.0))) if free else [0.0, 0.0]
        hit_prior, hit_line = 0.0, -math.inf
        if free:
            live_h = router.hit_rate(chain[0], req)
            hit_prior = (live_h * (h[1] + h0) - h[0]) / h0 if h0 > 0 else live_h
            pub = evidence.hits.get(chain[0])
            hit_line = pub - cfg.decision_hit_tolerance if pub is not None else -math.inf
        return cls(pair, free, c, prior, max(published - cfg.decision_tolerance, floor) if published is not None else -math.inf,
                   h, hit_prior, hit_line, cfg.request_decay, cfg.request_hit_decay, n0, h0,
                   decision_z(cfg, mode), own_trials(router, req, pair) - n0 - c[0] - c[1])

    def count(self, outcome) -> None:
        """One held cycle's outcome (as `Router._observe_rows` takes it into the request)."""
        chain = tuple(outcome.chain)
        if chain[:2] != self.pair:
            return
        if self.free:
            hit = int(outcome.drafted[0]) > 0
            self.hits = decayed_add(self.hits, (float(hit), 1.0), self.hit_decay, 1.0)
            self.moved = True
        a, r = acceptance_trials(int(outcome.drafted[1]), int(outcome.accepted[1]), outcome.k if self.free else None)
        if a + r:
            self.counts = decayed_add(self.counts, (a, r), self.decay, a + r)
            self.moved = True

    def estimate(self) -> float:
        """The request's alpha of the pair as the hold's trials carried it forward, less the
        decision margin (as `EvidenceBoard.alpha` reads it)."""
        c = self.counts
        n = c[0] + c[1]
        return decision_margin(shrink(c[0], n, self.prior, self.strength), n + self.strength + self.extra, self.z)

    def hit_estimate(self) -> float:
        """Its hit rate of the model-free drafter alike (`EvidenceBoard.hit_rate`)."""
        h = self.hits
        return decision_margin(shrink(h[0], h[1], self.hit_prior, self.hit_strength), h[1] + self.hit_strength, self.z)

    def refuted(self) -> bool:
        if not self.moved:
            return False
        return self.estimate() < self.line or (self.free and self.hit_estimate() < self.hit_line)
