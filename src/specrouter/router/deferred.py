"""Observations folded when read (lean19; on since lean20; was `RouterConfig.defer_observations`,
its False branch removed by prune23, issue 27).

An engine step's observation (policy.py `fold_step`: every row's trials, D_TV, hit rates, shadow
proposals, every forward's timing into the cost profile, the overheads, the batch calibration)
took ~0.13-0.15 ms of a single stream's ~12 ms step in the engine on a Sapphire Rapids, ~0.06 ms
replayed alone: the step's forwards evict the router's working set, so every step's fold starts
from a cold cache (`benchmarks/router_replay.py replay --evict`). A single stream's firm hold
(stream_hold.py) reads none of it but its row and the trials of its own first pair, so with
deferral, `observe_step` does at once for a firm hold's step (`StreamHolder.firm_step`) only
what the next planning reads (the step clock's pairing, the observed-step count, each row's cycle
count, the realized check's pending plan as the fold will consume it, the firm hold's trials) and
queues the report; the queue is folded, in order and exactly as step by step, where the evidence
is next read: the decision at the hold's end, a confident draft taken, a request finished, a
model failed, a report not of the hold (folded after the queue). Folded back to back, the reports
after the first run warm. A report whose fold raises loses its evidence, logged, as an
observe_step that raises in the engine does; the others fold and the planning's state is restored
all the same.

Every other report is folded at once, after the queue (defer21). lean19-20's rule queued every
report (a multi-row batch's speculative-hold and plain-hold steps too): exact, but not shown to
pay under load (session 20's serving bench read router / plain lower at c=4 and c=8 with it;
defer21's side-by-side runs could not tell the rules apart): removed (load22, issue 27).

What the fold reads of the planning between is restored per report (the observed-step count and
the row's pending realized check), so the deferred steps plan and learn exactly as without
deferral (the plans' digest on a recorded trace is the same). The batch planner's state is not
read by a one-row report's fold (`BatchPlanner.observe` returns below two rows) and no planning
runs between a firm hold's steps, so none of it is saved. A single stream's firm hold is released by its first pair's
trials during the hold as the hold counts them (`StreamHolder.tally`), not by the request's
folded estimate, and by its models' speed jumps as each held forward is read
(`StreamHolder.watch`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from specrouter.records.routing import StepReport, widened

logger = logging.getLogger("specrouter.router.deferred")


@dataclass
class Deferred:
    """A queued report and what its fold reads of the state at its time."""

    report: StepReport
    step: int  # the router's observed steps when it was observed
    pending: dict  # seq_id -> the row's pending realized check then (RequestState.pending)


class Deferral:
    """The queue of one `Router` (module docstring); `fold_step(router, report)` folds one."""

    def __init__(self, router, fold_step: Callable):
        self.router = router
        self.fold_step = fold_step
        self.queue: list[Deferred] = []
        self.folded = 0  # reports folded from the queue
        self.folds = 0  # folds of a non-empty queue

    def defer(self, report: StepReport) -> None:
        """`observe_step` of a firm hold's step: the eager part, and the report queued."""
        router = self.router
        router.outside.observed(router.observed_steps, report.wall_time, report.speculative,
                                widened(report.outcomes, report.forwards))
        router.planner.plan_seconds = 0.0  # a one-row step's planning: BatchPlanner.observe drops it
        pending = {}
        for o in report.outcomes:  # one row (`StreamHolder.firm_step`)
            req = router.requests.get(o.seq_id)
            if req is None:
                continue
            pending[o.seq_id] = req.pending
            req.cycles += 1  # TvSchedule reads it (undone and redone by the fold)
            req.pending = None  # the realized check consumes it (`Router._observe_realized`)
        self.queue.append(Deferred(report, router.observed_steps, pending))
        router.observed_steps += 1
        router.stream.tally(report)

    def fold(self) -> None:
        """Fold every queued report, in order, as `observe_step` would have one by one."""
        if not self.queue:
            return
        router = self.router
        queue, self.queue = self.queue, []
        now = router.observed_steps
        current = {}
        for item in queue:
            for seq in item.pending:
                req = router.requests.get(seq)
                if req is not None:
                    req.cycles -= 1
                    current.setdefault(seq, req.pending)
        try:
            for item in queue:
                router.observed_steps = item.step
                for seq, p in item.pending.items():
                    req = router.requests.get(seq)
                    if req is not None:
                        req.pending = p
                try:
                    self.fold_step(router, item.report)
                except Exception:  # noqa: BLE001 - the step's tokens are committed: only its evidence is lost
                    # as an observe_step that raises in the engine (engine/isolation.py `_report`):
                    # logged, what it folded before stays, the next reports fold after it
                    logger.exception("folding a deferred step's report (observed step %d, %d row(s)) raised; "
                                     "its evidence is lost, its tokens stand", item.step, len(item.report.outcomes))
        finally:  # the planning's state as it was, whatever a report did
            self.folded += len(queue)
            self.folds += 1
            router.observed_steps = now
            for seq, p in current.items():
                req = router.requests.get(seq)
                if req is not None:
                    req.pending = p
