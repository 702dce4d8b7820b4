"""Planning a step's batch (issue 14): every model runs one forward per step over all rows
that need it, padded to the widest row, so a row's speculation costs what it adds to shared
forwards. `BatchPlanner` owns what planning a batch needs beyond one row's decision: the plain
hold, the batch calibration, the timing of its own planning. `plan` weighs joint alternatives by
predicted step throughput; `step_seconds` predicts a step's seconds from the cost profile at the
forwards' real rows and widths. It asks its `Router` (policy.py) for each row's own decision and
reads the router's estimates; the router exposes it through `RouterProtocol` (protocol.py)."""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specrouter.records.routing import (BatchPlan, Chain, Decision, ForwardRecord, Plan, RowContext, RowOutcome,
                                         speculates, widened)
from specrouter.router.cost_model import processor_forwards
from specrouter.router.request_state import RequestState


@dataclass
class PlainHold:
    """The batch planner's last verdict was plain decoding for this many rows: they stay plain
    until step `until` (the router's observed steps) without re-planning."""

    rows: int  # rows + pinned rows of the batch it was found for (it holds for as many or more)
    until: int  # observed step at which the batch is planned again
    span: int  # steps of this hold (doubles while the verdict repeats)
    members: frozenset[int] = frozenset()  # seq_ids of the rows it was found for

    def valid(self, n: int, now: int) -> bool:
        """Does it still hold for a step of n rows (pinned ones included) at observed step
        `now`? Not once expired, nor when the batch shrank below `hold_floor`."""
        return now < self.until and n >= hold_floor(self.rows)

    def joined(self, rows: Sequence[RowContext], n: int) -> list[RowContext]:
        """The rows of a step it was not found for, below JOINS_KEEP_HOLD rows (none from
        there on). A joining request's own plan was never weighed: in a small batch one
        speculable row (code, a retry) turns the verdict, and with requests replacing each
        other (a server under steady load) a hold through joins kept 2-row batches plain for
        16 steps at a time where speculation realised 1.3x plain (measured,
        benchmarks/serve_engine.py); the planner weighs them (`BatchPlanner.plan`). In a
        large batch a joining row changes the verdict rarely and weighing it costs every step
        a row joins. From 4 rows on (the plain margin asks speculation to beat plain batching
        by 30% there, `BatchPlanner.plain_margin`) a join found the verdict plain in 44 of 45
        joins, each a decide of the joiner (~0.5-0.9 ms: a new request's first PlanTable), 0.03
        ms of a held 4-row step's ~0.16 ms of host time outside the executor against plain
        batching's ~0.06 (AMD EPYC Zen 5, serve_engine.py --trace): the joiner is planned with
        the batch at the hold's end (its first decision made there; the held steps' planning
        0.046-0.051 -> 0.031-0.034 ms a step, docs/router.md load26)."""
        if n >= JOINS_KEEP_HOLD:
            return []
        return [r for r in rows if r.seq_id not in self.members]

    def shadow_due(self, now: int) -> bool:
        """Shadow proposals at observed step `now` of the hold: on its last step only (one per
        span: their evidence is read when the hold ends; every 4th step they were ~0.6 ms of a
        ~10 ms 4-row step, measured). A single stream's ran every 4th held step before its hold
        ran on a lease (floor21; was `RouterConfig.plain_lease`, removed by prune23, issue 27)."""
        return now == self.until - 1


JOINS_KEEP_HOLD = 4  # from this many rows on, rows joining a held batch do not end its hold
SPAN_ROWS = 8  # a plain hold's longest span grows with the rows up to this many (`BatchPlanner.hold_limit`)


@dataclass(frozen=True)
class SpecHold:
    """A multi-row batch's speculative plans, kept for the same rows until step `until` (the
    router's observed steps) without re-planning (`RouterConfig.spec_hold_steps`)."""

    decisions: Mapping[int, Decision]  # seq_id -> the row's plan
    pinned: int  # pinned rows of the batch it was planned for
    until: int  # observed step at which the batch is planned again

    def holds(self, rows: Sequence[RowContext], pinned: int, now: int) -> bool:
        """Exactly the rows (and pinned rows) it was planned for, before `until`."""
        return (now < self.until and pinned == self.pinned and len(rows) == len(self.decisions)
                and all(r.seq_id in self.decisions for r in rows))


@dataclass
class StepCalibration:
    """What steps of one kind (speculative or plain) at one batch size took against the seconds
    the planner predicted for them: discounted sums over those steps (router/batch.py,
    `observe`). The planner's step seconds come from a cost profile swept row by row; in a
    multi-row batch their errors decide between speculation and plain batching, and only the
    steps themselves show them (a 2-row batch speculated where plain batching was 4-9% faster in
    two of three serving-bench rounds; 2-row speculative steps took 53 ms where 43.5 were
    predicted on a Zen 1, avx2 kernels).

    Seconds only, not the tokens a step committed: a row's accepted tokens are its request's own
    evidence (the router's per-request acceptance, which a single stream's plans trust with no
    batch factor at all), and a step's commit is a draw around them. Read with the tokens, the
    factor over ~10 steps at 2 rows on the mixed stream (AMD EPYC Zen 5) ran 0.68-1.61 (sd 0.15:
    its tokens' part 0.148, its seconds' part 0.043): a try ended on a short run of rejections
    and its low draw stood as the batch's error, turning 2-row speculation that realised 1.2-1.3x
    plain batching's rate plain for the rest of the run (docs/router.md, serve24)."""

    realised_seconds: float = 0.0  # the executor's step plus the router's planning of it
    predicted_seconds: float = 0.0
    weight: float = 0.0  # discounted count of steps
    running: bool = False  # the last step observed at this batch size (and mode) was of this kind
    # the last try of this kind (speculation: a run of its steps between plain steps) ended with
    # its evidence saying it loses to plain batching by the plain margin (`BatchPlanner.observe`):
    # its correction stands, not forgotten, until steps of this kind run again
    failed: bool = False
    # a failed try's factor over the other kind's (plain batching's) when it ended: the error
    # relative to plain steps of the same minutes, which `BatchPlanner.calibration` applies to
    # the plain factor of the moment (None: not failed)
    relative: float | None = None

    def add(self, realised_seconds: float, predicted_seconds: float, discount: float) -> None:
        self.realised_seconds = discount * self.realised_seconds + realised_seconds
        self.predicted_seconds = discount * self.predicted_seconds + predicted_seconds
        self.weight = discount * self.weight + 1.0

    def forget(self, factor: float) -> None:
        """Age the evidence (steps of this kind are not running): the factor drifts back to 1,
        `factor` per step; a failed try's evidence does not age. Its correction is the error
        the planner's prediction of such steps showed, so speculation at this batch size runs
        again where a plan's predicted gain clears it (a request that accepts more, a profile
        that makes speculation cheaper), not because plain steps ran: forgotten, a 2-row greedy
        batch on a Zen 1 (avx2 kernels) whose speculation realised ~0.85x plain batching's rate
        was tried again every 30-600 steps (7% of its steps speculative, and each try desyncs
        the pair: one request finishes first and the other runs alone)."""
        if self.failed:
            return
        self.realised_seconds *= factor
        self.predicted_seconds *= factor
        self.weight *= factor

    def factor(self, prior: float) -> float:
        """Predicted / realised seconds (the factor on a predicted throughput; ratio of sums),
        shrunk toward 1 by `prior` pseudo-steps."""
        if self.weight <= 0.0 or self.predicted_seconds <= 0.0 or self.realised_seconds <= 0.0:
            return 1.0
        ratio = self.predicted_seconds / self.realised_seconds
        return 1.0 + (ratio - 1.0) * self.weight / (self.weight + prior)


def sampled(rows: Sequence[RowContext] | Sequence[RowOutcome]) -> bool:
    """Does a batch have a sampled row (its calibration's mode, `BatchPlanner.calibration`)?"""
    return any(not r.greedy for r in rows)


def hold_floor(rows: int) -> int:
    """The fewest rows a plain hold found for `rows` rows still holds for: 3/4 of them (a row
    leaving a batch of 8 barely changes what speculation costs, and re-planning after every
    departure cost the router ~1% of the step time at 8 rows, measured), all of them below 4
    rows (where one row less makes speculation markedly cheaper)."""
    return rows if rows < 4 else math.ceil(0.75 * rows)


def planning(fn):
    """A planning method of the BatchPlanner: its seconds count toward the step it plans
    (`BatchPlanner.plan_seconds`, read by `observe`)."""
    @functools.wraps(fn)
    def timed(self, *args, **kwargs):
        t0 = self.router.timer()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.plan_seconds += self.router.timer() - t0
    return timed


class BatchPlanner:
    """Plans the batch of each engine step for a `Router` (module docstring)."""


    def __init__(self, router):
        self.router = router  # policy.Router: per-row decisions, estimates, cost profile
        self.hold: PlainHold | None = None  # the batch stays plain without re-planning until hold.until
        self.spec_hold: SpecHold | None = None  # a batch's speculative plans, kept until spec_hold.until
        self.held_decisions = 0  # row decisions the plain hold made (they log no DecisionEvent)
        # (rows, speculative, sampled) -> StepCalibration: multi-row steps' realised / predicted
        # rates, apart for batches with a sampled row (`calibration`)
        self.calibrations: dict[tuple[int, bool, bool], StepCalibration] = {}
        self.plan_seconds = 0.0  # the planning of the step being run (observe adds it to the step)
        self.planned: frozenset[int] = frozenset()  # seq_ids of the rows the last plan() planned
        # the observed steps (first, last) the engine runs on the last plan's lease without
        # asking (`BatchPlan.steps`); observe counts their rows as held decisions
        self.leased: tuple[int, int] | None = None
        self._plain_seconds: dict[tuple[int, int], tuple[float, int]] = {}  # plain_step_seconds' memo
        self._step_memo: tuple[int, dict] = (-1, {})  # step_seconds' memo: (published version, key -> seconds)
        self.events: deque = deque(maxlen=router.config.log_size)  # (row-cycle, rows, reason, rate, plain rate)

    # -- planning ---------------------------------------------------------------------------
    @planning
    def plan(self, rows: Sequence[RowContext], pinned: Sequence[Plan] = ()) -> BatchPlan:
        """`plan_afresh`, or plain decoding for every row while a plain hold lasts: under
        load, where plain continuous batching wins, re-planning every step would cost the router
        a few ms of every ~70 ms step for the same answer. The hold ends when the batch shrinks
        below `hold_floor` (fewer rows make speculation cheaper) or, below JOINS_KEEP_HOLD
        rows, when a row joins that would speculate on its own (`_joiners`: a joining row that
        decodes plainly joins the hold), and grows 2, 4, ... up to `RouterConfig.plain_hold_max`
        steps while the verdict repeats (`hold_limit`: longer while speculation's error stands).
        A single stream is held too once its row's plain plan is settled (decided "same"), while
        it runs alone (a request replacing it is planned at once). A multi-row batch's speculative plans are kept for the same rows
        `RouterConfig.spec_hold_steps` steps (`SpecHold`). Shadow proposals (free evidence for
        model-free drafters not running) every step, and while a hold lasts as
        `PlainHold.shadow_due` says (a batch's: on the hold's last step; a speculative hold's:
        on its last step only): under load their ~0.3 ms per row is a few % of plain
        batching's step for evidence nobody reads until the hold ends."""
        router = self.router
        hold, now = self.hold, router.observed_steps
        n = len(rows) + len(pinned)
        self.planned = frozenset(r.seq_id for r in rows)
        self.leased = None
        if not rows:
            decisions = []
        elif n > router.config.sampling_spec_max_batch and not any(r.greedy for r in rows):
            # no row may speculate (plan_afresh's rule for sampled rows): plain at once, no
            # decide, no shadow proposals, no confident drafts (held): all-plain steps cost what
            # plain batching's do (per-row planning and shadows after every ~11 ms forward cost
            # the router 4-5% at 4 sampled rows, measured)
            return BatchPlan(self.all_plain(rows), True, 0, self._lease(now, router.config.plain_hold_max))
        elif self.spec_hold is not None and self.spec_hold.holds(rows, len(pinned), now):
            self.held_decisions += len(rows)  # decided by the hold (no DecisionEvent each)
            spec = self.spec_hold
            # shadow proposals on the hold's last step only: their evidence is read when it ends
            return BatchPlan([spec.decisions[r.seq_id] for r in rows], True,
                             router.config.shadow_k if now == spec.until - 1 else 0)
        elif (decided := self._joiners(hold, rows, pinned) if hold is not None and hold.valid(n, now) else {}) is None:
            self.held_decisions += len(rows)  # decided by the hold (no DecisionEvent each)
            decisions = self.all_plain(rows)
        else:
            decisions = self.plan_afresh(rows, pinned, decided)
            self.spec_hold = None
            spec_span = router.config.spec_hold_steps
            spec = speculates([(d.chain, d.k) for d in decisions])
            if n > 1 and spec_span > 1 and spec:
                self.spec_hold = SpecHold({r.seq_id: d for r, d in zip(rows, decisions)}, len(pinned),
                                          now + spec_span)
                self.hold = None
                return BatchPlan(decisions, False, 0)  # shadows on the hold's last step
            limit = self.hold_limit(n, sampled(rows))
            # a single stream is held once its plain plan is settled (kept as the best: "same"):
            # deciding it again every step, its shadow proposals and confident-draft checks cost
            # ~0.8 ms of a ~9 ms plain step (chat at t=0.7), which target-only does not pay
            settled = n > 1 or (len(rows) == 1 and decisions[0].reason in ("same", "catch-up"))
            if limit > 0 and not spec and settled:
                span = min(limit, 2 * hold.span if hold is not None else 2)
                self.hold = PlainHold(n, now + span, span, frozenset(r.seq_id for r in rows))
            else:
                self.hold = None
        held = self.hold is not None
        shadow = 0 if held and not self.hold.shadow_due(now) else router.config.shadow_k
        # a held batch's plans stand until the step before its hold ends (that one shadows); a
        # single stream's too (floor21: a held plain step planned cost ~0.3 ms over target-only's
        # ~0.06 ms of host time, AMD EPYC, chat t=0.7; planning each was `RouterConfig.plain_lease`
        # False, removed by prune23, issue 27)
        steps = self._lease(now, self.hold.until - 1 - now) if held else 1
        return BatchPlan(decisions, held, shadow, steps)

    STANDING_HOLD = 4  # a plain hold's longest span is this many times plain_hold_max while speculation's error stands

    def hold_limit(self, n: int, sampled: bool) -> int:
        """The longest plain hold of a batch of n rows: `RouterConfig.plain_hold_max` steps for
        each row beside the first (the plain margin grows so, `plain_margin`: a re-plan finds
        speculation past it less often as the batch grows), or STANDING_HOLD times
        plain_hold_max where that is longer, while the last try of speculation at this batch
        size failed (`StepCalibration.failed`: its correction stands). Re-planning at a hold's
        end decides every row, to find the same verdict while the error stands unless a plan's
        predicted gain grew past it: a 2-row greedy batch on a Zen 1 (avx2 kernels) was
        re-planned every 16 steps, 32 times in 512 steps, each 6-10 ms of decide() for plain
        every time (in-process, the serving bench's stream), ~1.3% of its time. A row joining
        the hold is still weighed at once below JOINS_KEEP_HOLD rows (`_joiners`), and a row
        leaving still ends it (`hold_floor`).

        At 4 rows (AMD EPYC Zen 5, serve_engine.py --trace, load25) a batch whose speculation
        never failed re-planned every 16 steps at ~1.5 ms (4 decides) for plain every time,
        0.105 ms of its held steps' 0.24 ms outside the executor (plain batching's 0.05). From
        JOINS_KEEP_HOLD rows on (4 since load26; 8 in load22, which held 2x plain_hold_max there)
        the hold's end is the only re-check (joins keep it) and a re-plan decides every row (~1.4-2.2
        ms at 8 rows); held 8-row steps' host
        seconds outside the executor went 0.31-0.37 -> 0.19-0.25 ms with 32-step holds."""
        limit = self.router.config.plain_hold_max
        spec = self.calibrations.get((n, True, sampled))
        standing = self.STANDING_HOLD if spec is not None and spec.failed else 1
        # no longer than at SPAN_ROWS rows (112 steps): a joining row waits for the hold's end
        # (from JOINS_KEEP_HOLD rows on), and nothing above 8 rows was measured (review25 N12)
        return limit * max(min(n, SPAN_ROWS) - 1, standing)

    def _lease(self, now: int, steps: int) -> int:
        """`BatchPlan.steps` of a held plain batch (a single stream's too) planned at observed step `now`: its plain
        plans stand `steps` steps for the same rows (at least this one). The engine runs them
        without planning (no row contexts, no plan) and reports them to the router when the
        lease ends, in order, before it plans again: the router's observation of a held step
        then runs in a row with the others, not after each forward, and what it learns is the
        same (nothing reads it before the lease ends). A row joining or leaving, a finished
        request or a failed model ends the lease at once (engine.py `Engine._plan_step`)."""
        steps = max(1, steps)
        self.leased = (now + 1, now + steps - 1) if steps > 1 else None
        return steps

    def _joiners(self, hold: PlainHold, rows: Sequence[RowContext], pinned: Sequence[Plan] = ()
                 ) -> dict[int, Decision] | None:
        """The rows that joined a valid hold (`PlainHold.joined`), decided on their own at this
        step's batch size: when every one decodes plainly, or their speculation does not beat
        plain batching of the step as the batch calibration says such steps realise
        (`joiners_gain`), they join the hold (None: the batch stays held, its other rows
        undecided); else their decisions (seq_id -> Decision), for `plan_afresh` to weigh the
        batch with (and another request running alone ends the hold: {}). Re-planning every row
        at each join cost ~1.5 ms of a ~10 ms 4-row step (Zen 4) and 6-10 ms of a 30-60 ms step
        on a Zen 1 (avx2), where 2-row speculation realised ~0.6x plain's rate and every join of
        a request that speculates alone was planned afresh, to be found plain (measured,
        benchmarks/serve_engine.py --trace)."""
        n = len(rows) + len(pinned)
        joined = hold.joined(rows, n)
        if not joined:
            return None
        if n < 2:  # another request alone: held only once its own plain plan is settled
            return {}
        decided = {r.seq_id: self.router.decide(r) for r in joined}
        if speculates([(d.chain, d.k) for d in decided.values()]) and self.joiners_gain(rows, decided, pinned):
            return decided
        hold.members = hold.members | decided.keys()
        return None

    def joiners_gain(self, rows: Sequence[RowContext], decided: Mapping[int, Decision],
                     pinned: Sequence[Plan] = ()) -> bool:
        """Does the step gain from the joining rows' own plans (`decided`; the held rows plain),
        or those plans with k capped as `plan_afresh` caps them, over plain batching by the
        margin `plan_afresh` asks of a multi-row batch, each option's predicted rate scaled by
        the batch calibration? The question a join puts to a hold (its rows were found plain for
        the batch, the joiner was never weighed), answered as `plan_afresh` would answer it when
        the held rows' own plans are plain."""
        router, cfg = self.router, self.router.config
        plain = ((router.target,), 0)
        own = [(decided[r.seq_id].chain, decided[r.seq_id].k) if r.seq_id in decided else plain for r in rows]
        L = max(1, sum(r.context_len for r in rows) // len(rows))
        factors = self.calibration(len(rows) + len(pinned), sampled(rows))
        flags, lags = [r.processors for r in rows], [r.lags for r in rows]
        reqs = [router.requests.get(r.seq_id) for r in rows]

        def rate(plans: list[Plan]) -> float:
            tokens = sum(self.expected_tokens(req, c, k) for req, (c, k) in zip(reqs, plans))
            return self.rate(plans + list(pinned), tokens + len(pinned), L, factors, flags, lags)

        top = max(k for _, k in own)
        best = max([rate(own)] + [rate([(c, min(k, cap)) for c, k in own]) for cap in (1, 2, 3, 4, 6, 8) if cap < top])
        return best > rate([plain] * len(rows)) * self.plain_margin(len(rows) + len(pinned))

    def plain_margin(self, n: int) -> float:
        """The factor by which a step of n rows (pinned ones included) that speculates must be
        predicted to beat plain batching of its rows before it leaves plain (`plan_afresh`,
        `joiners_gain`, `take_confident_drafts`): `RouterConfig.batch_plain_margin` for each row
        beside the first, at least `persist_margin` (a single row: `persist_margin` only, its own
        decision's hysteresis).

        A speculating row slows every other row of its step, and the rows do not commit alike:
        they finish out of step, so a stream's last requests run in smaller batches than plain
        batching's, whose rows end together. At 4 rows on the serving bench's stream (AMD EPYC Zen
        5, greedy, benchmarks/serve_engine.py) the router's 4-row speculative steps realised
        1.12-1.20x plain batching's rate in the step (planning included) in the runs where it
        chose them, and those rounds read 0.93-0.97x plain: their last requests ran in
        104 more steps of 1-3 rows than their tokens needed at 4 rows, over six rounds, ~6% of the
        router's time (docs/router.md, load25). The margin grows with the rows a speculating row
        slows; at 2 rows it is the margin it was (2-row speculative steps realised 1.2-1.3x
        plain batching's rate in the step, serve24, and their runs 0.95-1.15x, load25)."""
        cfg = self.router.config
        return 1.0 + max(cfg.persist_margin, cfg.batch_plain_margin * (n - 1))

    def plan_afresh(self, rows: Sequence[RowContext], pinned: Sequence[Plan] = (),
                    decided: Mapping[int, Decision] | None = None) -> list[Decision]:
        """The plans of a step's rows, chosen for the batch the step really runs.

        Every model runs one forward per step over all rows that need it, padded to the widest
        row, so a row's speculation costs what it adds to shared forwards: a batch of plain rows
        costs the target one 1-token forward of b rows, one speculating row makes it (b, k + 1).
        1. each row's own best plan (`Router.decide`, with cost rows at the step's b; `decided`:
           those already made this step, by seq_id);
        2. joint alternatives: every row plain; the speculating rows' k capped at K; only the m
           rows that gain most speculate;
        3. the predicted step throughput of each, sum of E[tokens] / predicted step seconds
           (`step_seconds`: every model's forwards at their real rows and widths, pinned rows
           included); the rows' own plans stay unless an alternative is better by more than
           `persist_margin`, and plain decoding wins unless speculation beats it by that much
           (by `plain_margin(n)` in a multi-row batch)."""
        router, cfg = self.router, self.router.config
        n = len(rows) + len(pinned)
        if n > router.profile.max_batch(router.target):
            # beyond the swept batch sizes the step's cost is a linear extrapolation: no
            # speculation is planned on it (measured: 16 rows speculated where plain won by 10-17%)
            return self.all_plain(rows)
        plain = (router.target,)
        decided = decided or {}
        decisions = [decided.get(r.seq_id) or router.decide(r) for r in rows]
        if n == 1:
            # a single stream: the row's own decision already is the argmin of the same cost
            # model (its own overheads, no other row to slow down); weighing the joint
            # alternatives cost ~0.2 ms per step and could only undo its hysteresis. Only a
            # draft's catch-up, which decide() prices at one token, is weighed (`alone`)
            return [self.alone(rows[0], decisions[0])] if rows else decisions
        if n > cfg.sampling_spec_max_batch:
            # a sampled row's acceptance is estimated from similarity (1 - D_TV), above what its
            # coupled drafts get: in the serving bench at t=0.7 and 8 rows the router lost ~3% to
            # plain batching in two runs of three rounds (RouterConfig.sampling_spec_max_batch)
            decisions = [d if r.greedy or len(d.chain) == 1 else Decision(plain, 0, d.t_eff, "batch-plain")
                         for r, d in zip(rows, decisions)]
        L = max(1, sum(r.context_len for r in rows) // len(rows))
        reqs = [router.requests.get(r.seq_id) for r in rows]
        factors = self.calibration(n, sampled(rows))
        flags = [r.processors for r in rows]  # pinned rows: not charged (their plan is fixed)
        lags = [r.lags for r in rows]

        def option(plans: list[Plan]) -> tuple[float, list[Plan]]:
            tokens = sum(self.expected_tokens(req, c, k) for req, (c, k) in zip(reqs, plans))
            tokens += len(pinned)  # pinned rows commit >= 1 token each, whatever we choose
            return self.rate(list(plans) + list(pinned), tokens, L, factors, flags, lags), plans

        own = [(d.chain, d.k) for d in decisions]
        if all(len(c) == 1 for c, _ in own):
            return decisions
        options = [option(own), option([(plain, 0)] * len(rows))]
        top = max(k for _, k in own)  # >= 1: some row speculates (a chain of two or more levels has k >= 1)
        for cap in (1, 2, 3, 4, 6, 8):
            if cap < top:
                options.append(option([(c, min(k, cap)) if k else (c, k) for c, k in own]))
        gain = sorted(range(len(rows)), key=lambda i: -self.expected_tokens(reqs[i], *own[i]))
        spec = [i for i in gain if own[i][1] > 0]
        for m in range(1, len(spec)):
            keep = set(spec[:m])
            options.append(option([own[i] if i in keep else (plain, 0) for i in range(len(rows))]))
        rate_own, rate_plain = options[0][0], options[1][0]
        rate, best = max(options, key=lambda o: o[0])
        margin = 1.0 + cfg.persist_margin
        # in a multi-row batch a speculating row slows every row of the step: speculation must
        # beat plain continuous batching by `batch_plain_margin` for each row beside the first
        # (its acceptance is an estimate, and rows that commit unlike finish out of step)
        plain_margin = self.plain_margin(n)
        if rate_plain * plain_margin >= rate:
            best, reason = options[1][1], "batch-plain"
        elif rate_own * margin >= rate:
            return decisions
        else:
            reason = "batch"
        self.events.append((router.similarity.now, n, reason, rate, rate_plain))
        out = []
        for d, (c, k) in zip(decisions, best):
            if (c, k) != (d.chain, d.k):
                d = Decision(c, k, d.t_eff, reason, d.min_confidence if c == d.chain else 0.0)
            out.append(d)
        return out

    def alone(self, row: RowContext, decision: Decision) -> Decision:
        """A single stream's own decision, or plain decoding where it speculates with a model
        below the target that lags (`RowContext.lags`: a draft after plain steps) and that
        model's catch-up, spread over the cycles the row has left at the plan's expected tokens
        (at most `plain_hold_max`), leaves its predicted rate at or below plain decoding's.
        decide() prices the draft's first forward at one token: a row left alone near its end
        by the other row of its batch (speculation desynchronises a pair, one finishes a few
        tokens earlier) caught its draft up over every held step's tokens for a cycle or two, on
        a Zen 1 (avx2 kernels, serving bench greedy c=2) 41 such steps of 67 ms for 1.9 tokens
        against 21 ms a held token. A new request's prompt is its draft's catch-up too, spread
        over at most `plain_hold_max` cycles (weighed over the whole request, a code request
        with a long prompt speculated and lost: docs/router.md, 20976a7).

        The tokens the row generated while its draft did not run (`RowContext.lags_generated`:
        plain steps) are spread over every cycle the request has left: their catch-up is one
        forward that buys the rest of the request, paid once. Capped like the prompt's, it was
        priced again at every plain step, each time over more tokens and never over more than 16
        cycles, so a lone request that once decoded plainly stayed plain to its end (the
        catch-up trap, docs/serving-performance.md, eleventh round).

        A probe (router/probing.py) runs as decided: it is chosen because the request's own
        estimate may be wrong, so weighing it at that estimate vetoed every probe of a model
        draft after plain steps (a lagging draft), and a prose request whose draft was refuted by
        its first two cycles decoded plainly to its end at 0.64x what draft>target k=4 ran
        (Sapphire Rapids, stale16); its cost, catch-up included, is the probe budget's
        (`Prober.settle`; the veto was `RouterConfig.probe_past_catch_up=False`, removed by
        prune23, issue 27)."""
        chain, k = decision.chain, decision.k
        lags = dict(row.lags)
        if (k == 0 or len(chain) < 2 or not any(lags.get(m, 1) > 1 for m in chain[:-1])
                or decision.reason == "probe"):
            return decision
        router = self.router
        req = router.requests.get(row.seq_id)
        tokens = self.expected_tokens(req, chain, k)
        most = router.config.plain_hold_max
        left = row.remaining if row.remaining is not None else most * tokens
        every = max(1, math.ceil(left / tokens))  # the cycles the request has left
        cycles = min(most, every)
        L, flags, plan = max(1, row.context_len), [row.processors], [(chain, k)]
        seconds = self.step_seconds(plan, L, processors=flags, lags=[row.lags], span=cycles)
        made = dict(row.lags_generated)
        if every > cycles and any(made.get(m, 0) > 0 for m in lags):
            # the catch-up term is linear in 1 / span: the prompt's share over `cycles`, the
            # generated tokens' over `every`
            prompt = tuple((m, lag - made.get(m, 0)) for m, lag in row.lags)
            seconds = (self.step_seconds(plan, L, processors=flags, lags=[prompt], span=cycles)
                       + self.step_seconds(plan, L, processors=flags, lags=[row.lags], span=every)
                       - self.step_seconds(plan, L, processors=flags, lags=[prompt], span=every))
        spec = tokens / seconds
        plain = 1.0 / self.step_seconds([((router.target,), 0)], L, processors=flags)
        if spec > plain:
            return decision
        if req is not None:
            req.pending = None  # no realized check of a plan another part changed
        return Decision((router.target,), 0, 1.0 / plain, "catch-up")

    def all_plain(self, rows: Sequence[RowContext]) -> list[Decision]:
        """Plain decoding for every row, decided for the batch (no per-row decide)."""
        plain = (self.router.target,)
        return [Decision(plain, 0, math.nan, "batch-plain", 0.0) for _ in rows]

    @planning
    def take_confident_drafts(self, rows: Sequence[RowContext], plans: list[Plan],
                              offers: dict[int, tuple[str, int, float]],
                              pinned: Sequence[Plan] = ()) -> list[Plan]:
        """Suffix decoding's rule, weighed by the cost model: row i's model-free drafter offers
        a draft of m tokens now (`offers[i] = (drafter, m, score)`, score = the drafter's own
        expected accepted tokens, the sum of its cumulative confidences: a long match in earlier
        requests, e.g. an exact retry, offers a long confident draft). Row i switches to
        (drafter > target, m) when that raises the step's predicted throughput (E[tokens] over
        `step_seconds`, the other rows' plans as they are); offers are taken best first. The
        router's own acceptance estimates cannot see such a draft coming: they average over the
        request's cycles. A multi-row step whose plans are all plain leaves plain for a confident
        draft only past `plain_margin`, as for any other plan: at 4 rows such drafts (one row's
        suffix draft of 11-16 tokens beside three plain rows) ran 10.8-18.4 ms where 6.4-7.8 were
        predicted (a packed forward with one wide row costs more than its mean width says), and at
        2 rows a suffix k=1 draft committed 1.10-1.24 tokens a cycle (docs/router.md, load25)."""
        if not offers:
            return plans
        router = self.router
        L = max(1, sum(r.context_len for r in rows) // len(rows))
        reqs = [router.requests.get(r.seq_id) for r in rows]
        tokens = [self.expected_tokens(req, c, k) for req, (c, k) in zip(reqs, plans)]
        best = list(plans)
        factors = self.calibration(len(rows) + len(pinned), sampled(rows))

        def rate(ps: list, toks: list) -> float:
            return self.rate(ps + list(pinned), sum(toks) + len(pinned), L, factors, [r.processors for r in rows],
                             [r.lags for r in rows])

        current = rate(best, tokens)
        n = len(rows) + len(pinned)
        for i, (name, m, score) in sorted(offers.items(), key=lambda o: -o[1][2]):
            chain = (name, router.target)
            if chain not in router.chain_index or 1.0 + score <= tokens[i]:
                continue
            trial, t2 = best.copy(), tokens.copy()
            trial[i], t2[i] = (chain, m), 1.0 + score
            r = rate(trial, t2)
            # leaving plain (no row of the step speculates yet) asks the plain margin
            leaves = n > 1 and not speculates(list(best) + list(pinned))
            if r > current * (self.plain_margin(n) if leaves else 1.0):
                best, tokens, current = trial, t2, r
        return best

    # -- predictions ------------------------------------------------------------------------
    def expected_tokens(self, req: RequestState | None, chain: Chain, k: int) -> float:
        """E[target tokens committed per cycle] of a plan, from the request's last PlanTable."""
        if len(chain) == 1 or k == 0 or req is None or req.table is None:
            return 1.0
        i = self.router.chain_index.get(chain)
        if i is None or k > req.table.expected_tokens.shape[1]:
            return 1.0
        e = float(req.table.expected_tokens[i, k - 1])
        return e if math.isfinite(e) else 1.0

    def step_seconds(self, plans: Sequence[Plan], context_len: int, publish: bool = True,
                     processors: Sequence[bool] = (), lags: Sequence[Sequence[tuple[str, int]]] = (),
                     span: int | None = None) -> float:
        """Predicted seconds of one engine step running `plans` (one per row): every model's
        forwards at their real rows and widths (the verifier at level j of a row with draft
        length k gets at most k + j - 1 candidates; padded to the widest row, or packed: the
        mean width, for runners that pack ragged batches), drafting steps (each with its host
        work), the step overhead, and the logits processors of the rows flagged in `processors`
        (one per plan; missing: none) per forward they take part in
        (`cost_model.processor_forwards`).
        `lags` (one per plan, `RowContext.lags`; missing: none): the tokens a speculating row's
        models below the target have not seen widen their first forward (a draft catching up
        after plain steps: ~2x a 2-row step's predicted seconds on a Zen 1, avx2 kernels); the
        catch-up is paid once per switch to speculation, so it is charged over CATCH_UP_SPAN
        steps (`span`: over that many steps instead), what the switch buys at least.
        `publish`: as `EvidenceBoard.predict`.
        Memoized (`_step_memo`): the same plans, context bucket, flags, lags and span under the
        same published evidence and overheads are the same seconds, computed once."""
        router = self.router
        board = router.board
        # the version every prediction below reads (board.predict: publishing, when asked, first;
        # then nothing changes it until the step's predictions are made: they read it as published)
        version = (board.current() if publish or board.published is None else board.published).version
        if not self.STEP_MEMO:
            return self._step_seconds(plans, context_len, processors, lags, span)
        overhead = router.overhead
        n = len(plans)
        key = (tuple(plans), context_len // router.config.context_bucket,
               tuple(i for i, (_, on) in enumerate(zip(plans, processors)) if on),
               tuple(tuple(lags[i]) if i < len(lags) and k > 0 and len(c) > 1 else () for i, (c, k) in enumerate(plans)),
               span, overhead["spec"], overhead["plain"], overhead["processor"], overhead["draft_step"], n)
        memo = self._step_memo
        if memo[0] != version or len(memo[1]) >= self.STEP_MEMO_SIZE:
            memo = self._step_memo = (version, {})
        seconds = memo[1].get(key)
        if seconds is None:
            seconds = memo[1][key] = self._step_seconds(plans, context_len, processors, lags, span)
        return seconds

    # the steps a switch to speculation is charged its draft's catch-up over (`step_seconds`):
    # the speculative hold's span before load26 (`RouterConfig.spec_hold_steps` 2), which the
    # plain margins were measured with. Charged over the 4-step hold since, 4-row speculation was
    # planned in 4 of 4 runs (9-44 steps a run, serve_engine.py c=4) and through the server (31
    # steps; its round 618 tok/s against 650 held plain), where charged over 2 steps it was
    # planned in 1 of 7 (docs/router.md, load26)
    CATCH_UP_SPAN = 2
    STEP_MEMO = True  # False: step_seconds computes every call (tests compare the two)
    STEP_MEMO_SIZE = 4096  # entries kept per published version

    def _step_seconds(self, plans: Sequence[Plan], context_len: int, processors: Sequence[bool] = (),
                      lags: Sequence[Sequence[tuple[str, int]]] = (), span: int | None = None) -> float:
        """`step_seconds`, computed on the evidence as published (`step_seconds` publishes first)."""
        router = self.router
        verify: dict[str, list[int]] = {}  # model -> widths of the rows it verifies / drafts (first step)
        behind: dict[str, list[int]] = {}  # the same, each row's unseen tokens (lags) added
        draft: dict[str, list[int]] = {}  # model drafter -> draft lengths
        speculative = False
        for i, (chain, k) in enumerate(plans):
            if len(chain) == 1 or k == 0:
                verify.setdefault(chain[-1], []).append(1)
                behind.setdefault(chain[-1], []).append(1)
                continue
            speculative = True
            lag = dict(lags[i]) if i < len(lags) and lags[i] else {}
            draft.setdefault(chain[0], []).append(k)
            for j, m in enumerate(chain[1:], start=1):
                verify.setdefault(m, []).append(k + j)
                behind.setdefault(m, []).append(k + j + max(0, lag.get(m, 1) - 1))
            behind.setdefault(chain[0], []).append(max(1, lag.get(chain[0], 1)))
        total = router.overhead["spec" if speculative else "plain"]
        total += router.overhead["processor"] * sum(processor_forwards(c, k, router.model_free)
                                                    for (c, k), on in zip(plans, processors) if on)
        board_predict = router.board.predict

        def predict(m: str, b: int, t: float, L: int) -> float:
            return board_predict(m, b, t, L, False)

        def width(m: str, widths: list[int]) -> float:  # a packing runner costs its valid tokens
            return sum(widths) / len(widths) if m in router.packed else max(widths)

        span = max(1, self.CATCH_UP_SPAN if span is None else span)
        for m in router.order:
            ks = draft.get(m, [])
            if m in router.model_free:
                if ks and m in router.profile:
                    total += predict(m, len(ks), max(ks), context_len)
                continue
            widths = verify.get(m, []) + [1] * len(ks)
            if widths:
                first = predict(m, len(widths), width(m, widths), context_len)
                caught = width(m, behind[m])
                total += first if caught <= width(m, widths) else \
                    first + (predict(m, len(widths), caught, context_len) - first) / span
            if ks:
                step_host = router.overhead["draft_step"]
                for i in range(2, max(ks) + 1):  # the draft's later steps, over the rows still drafting
                    total += predict(m, sum(1 for k in ks if k >= i), 1, context_len) + step_host
        return max(total, 1e-9)

    PLAIN_PREDICTION_STEPS = 16  # a plain step's predicted seconds are reused this many steps

    def plain_step_seconds(self, n: int, context_len: int) -> float:
        """`step_seconds` of n plain rows at a context of `context_len`, computed at most once
        per PLAIN_PREDICTION_STEPS observed steps per (n, context bucket): the calibration of
        plain steps reads it after every step (a held batch's steps are almost all plain), and
        over that many steps the profile's EMA moves it by far less than the steps' own noise."""
        key = (n, context_len // self.router.config.context_bucket)
        now = self.router.observed_steps
        hit = self._plain_seconds.get(key)
        if hit is None or now - hit[1] >= self.PLAIN_PREDICTION_STEPS:
            plans = [((self.router.target,), 0)] * n
            hit = self._plain_seconds[key] = (self.step_seconds(plans, context_len, publish=False), now)
        return hit[0]

    def calibration(self, n: int, sampled: bool = False) -> tuple[float, float]:
        """(speculative, plain) factors on the predicted throughput of a step of n rows (1, 1
        for a single row, whose plans the per-row evidence already corrects), learned from
        batches with a sampled row apart from all-greedy ones: what speculation realises
        against its prediction differs by mode (a sampled row's acceptance is estimated from
        1 - D_TV, a greedy row's through the greedy calibration), and a server that ran greedy
        requests must not carry their factor into sampled ones (the serving bench runs t=0,
        then t=0.7, on one server)."""
        if n < 2:
            return 1.0, 1.0
        prior = self.router.config.batch_calibration_prior
        spec, plain = self.calibrations.get((n, True, sampled)), self.calibrations.get((n, False, sampled))
        plain_factor = plain.factor(prior) if plain is not None else 1.0
        if spec is not None and spec.relative is not None:
            # a failed try's error stands relative to plain batching: the plain factor moves
            # with the machine's minutes (+-10-20% over its ~10-step window on a Zen 1), and a
            # standing speculative factor read against a plain factor of slower minutes looked
            # like a gain (a 2-row greedy batch tried again 38 times in ~1000 steps, in-process)
            return spec.relative * plain_factor, plain_factor
        return spec.factor(prior) if spec is not None else 1.0, plain_factor

    def rate(self, plans: Sequence[Plan], tokens: float, context_len: int,
             factors: tuple[float, float], processors: Sequence[bool] = (),
             lags: Sequence[Sequence[tuple[str, int]]] = ()) -> float:
        """Predicted committed tokens per second of a step running `plans` (every row's, pinned
        ones included) that commits `tokens`, scaled by what such steps realised (`calibration`);
        `processors`, `lags`: as `step_seconds`."""
        return factors[0 if speculates(plans) else 1] * tokens / self.step_seconds(
            plans, context_len, processors=processors, lags=lags)

    # -- observing --------------------------------------------------------------------------
    def observe(self, rows: Sequence[RowOutcome], forwards: Sequence[ForwardRecord], wall_time: float) -> None:
        """Calibrate the planner on one multi-row step: its seconds (the executor's `wall_time`
        plus the planning of the step) against the seconds the planner predicts for the plans
        that ran (`StepCalibration`: seconds, not tokens); the other kind of step at this batch
        size ages. A step that prefills a joining row's prompt is not a step of either kind (its
        forward is wider than any plan's), nor one where a model catches up on tokens it has not
        seen (a draft after plain steps: `step_seconds` prices that from the rows' lags), nor is
        one where a row the planner did not plan speculates (a pinned chain, e.g. a client's
        `specrouter_chain`): the calibration corrects the planner's own plans (the serving bench
        runs its static chains through the router's server).

        A try of speculation that ends (the first plain step after its steps) failed when its
        factor over plain batching's, read in the same minutes, loses by the plain margin: the
        machine running slower than its profile slows both kinds alike (2-row steps of both ran
        ~7% over their predictions here, AMD EPYC Zen 5), which is no evidence against
        speculation; read alone, such a factor found 2-row tries failed at random."""
        plan_seconds, self.plan_seconds = self.plan_seconds, 0.0
        router, cfg = self.router, self.router.config
        if self.leased is not None and self.leased[0] <= router.observed_steps <= self.leased[1]:
            self.held_decisions += len(self.planned)  # a step of the lease: the hold decided its rows
        n = len(rows)
        if n < 2 or wall_time <= 0.0:
            return
        plans = [(tuple(r.chain), r.k) for r in rows]
        if any(r.seq_id not in self.planned for r, (c, k) in zip(rows, plans) if len(c) > 1 and k > 0):
            return
        if widened(rows, forwards):  # a prefill, or a model's catch-up
            return
        spec = speculates(plans)
        L = max(1, sum(r.context_len for r in rows) // n)
        predicted_seconds = self.step_seconds(plans, L, publish=False) if spec else self.plain_step_seconds(n, L)
        mode = sampled(rows)
        cal = self.calibrations.setdefault((n, spec, mode), StepCalibration())
        cal.add(wall_time + plan_seconds, predicted_seconds, cfg.batch_calibration_discount)
        cal.running = True
        if spec:  # a try runs: its verdict is made again when it ends
            cal.failed, cal.relative = False, None
        other = self.calibrations.get((n, not spec, mode))
        if other is not None:
            if other.running and not spec:
                # a try of speculation at this batch size just ended: it failed when what its
                # steps realised (with what was left of the older evidence), over what plain
                # steps realise now, loses by the plain margin; a failed try's correction stands
                prior = cfg.batch_calibration_prior
                relative = other.factor(prior) / cal.factor(prior)
                other.failed = bool(relative * (1.0 + cfg.batch_plain_margin) < 1.0)
                other.relative = relative if other.failed else None
            other.running = False
            other.forget(cfg.batch_calibration_forget)
