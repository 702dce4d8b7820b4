"""Observations folded when read (router/deferred.py): a single stream's firm hold's steps are
queued, and released by its own first pair's trials as it counts them; other steps are folded
at once (defer21), and the run plans and learns exactly as with every queued report folded at
once (the reference, `scripted(defer=False)`; the deferral's "as before" path, a firm hold
released by the request's folded estimate, was `RouterConfig.defer_observations=False`,
removed by prune23, issue 27)."""

from __future__ import annotations

import dataclasses

import pytest
from test_planner_memo import build_router, scripted_run
from test_stream_hold import settled, stream

from specrouter.router.similarity import GREEDY


def scripted(defer: bool, spec_hold_steps: int, steps: int = 400, seed: int = 1):
    """The planner-memo test's scripted serving run (concurrency 1 -> 8 -> 2 -> 4): every
    step's plans as planned, and the router. `defer` False: each queued report is folded at
    once (observed step by step, the hold's trials counted as with deferral)."""
    router = build_router()
    router.config = dataclasses.replace(router.config, spec_hold_steps=spec_hold_steps)
    if not defer:
        queue = router.deferral.defer

        def at_once(report):
            queue(report)
            router.deferral.fold()
        router.deferral.defer = at_once
    router.realized_log = []  # each finished request's realized check, as finish_request saw it (`state`)
    finish = router.finish_request

    def finished(seq_id):
        router.deferral.fold()  # what finish_request does first
        req = router.requests.get(seq_id)
        if req is not None:
            router.realized_log.append((seq_id, tuple(sorted((c, tuple(v)) for c, v in req.realized.items())),
                                        tuple(sorted(req.corrections.items()))))
        finish(seq_id)
    router.finish_request = finished
    return scripted_run(steps, seed, router), router


def state(router) -> tuple:
    """What the router learned: global alphas and hit rate, the profile's version and speeds,
    the steps observed, the batch calibration, the overheads, and each request's realized check
    (the finished ones' as they finished: `scripted`)."""
    sim = router.similarity
    return (tuple(sim.alpha(p, GREEDY) for p in router.pairs), sim.hit_rate("ngram"), router.profile.version,
            tuple(router.profile.speed(m) for m in router.order if m in router.profile), router.observed_steps,
            tuple(sorted((k, c.weight, c.realised_seconds) for k, c in router.planner.calibrations.items())),
            tuple(sorted(router.overhead.items())), tuple(getattr(router, "realized_log", ())),
            tuple(sorted((s, tuple(sorted((c, tuple(v)) for c, v in r.realized.items())))
                         for s, r in router.requests.items())))


@pytest.mark.parametrize("span,seed", [(2, 1), (4, 1), (2, 0), (2, 3)])
def test_deferred_observations_plan_a_batch_as_observed_step_by_step(span, seed):
    """The same scripted run plans the same steps (plans, reasons, predicted T_eff, holds,
    shadows, leases) and ends knowing the same as with every queued report folded at once;
    deferral did defer (fewer folds than queued reports: a firm hold's steps folded together,
    in the run's single-stream phase). (Seeds 0 and 3 parted, a firm hold ending a step apart,
    against the old reference without deferral, which released a firm hold by the request's
    folded estimate: review21 N3; that path was removed by prune23.)"""
    off_log, off = scripted(False, span, seed=seed)
    on_log, on = scripted(True, span, seed=seed)
    assert on_log == off_log
    on.deferral.fold()
    assert state(on) == state(off)
    assert 20 <= on.deferral.folded < on.observed_steps, (on.deferral.folded, on.observed_steps)
    assert on.deferral.folds <= on.deferral.folded - 10, (on.deferral.folds, on.deferral.folded)
    assert off.deferral.folds == off.deferral.folded  # the reference: one fold per queued report
    held = sum(1 for _, h, _, _ in on_log if h)
    assert held > 20, held  # the run has holds (speculative and plain)


def test_by_default_a_batchs_steps_are_folded_at_once_and_plan_as_without(monkeypatch):
    """defer21: only a single stream's firm hold queues its reports; a multi-row batch's (its
    speculative hold's included) are folded as they are observed, so the queue never outlives
    its observe_step by more than a firm hold's steps, and the run plans and learns as with
    every queued report folded at once. Negative control: every report queued (lean19-20's rule, removed
    by load22: `StreamHolder.firm_step` always true) leaves a multi-row step's report queued."""
    from specrouter.router.policy import Router
    from specrouter.router.stream_hold import StreamHolder

    def run(every):
        depths = []
        observe = Router.observe_step

        def observed(self, report):
            observe(self, report)
            if len(report.outcomes) > 1:
                depths.append(len(self.deferral.queue))
        monkeypatch.setattr(Router, "observe_step", observed)
        if every:
            monkeypatch.setattr(StreamHolder, "firm_step", lambda self, report: True)
        log, router = scripted(True, 4)
        monkeypatch.undo()
        return log, router, depths

    off_log, off = scripted(False, 4)
    log, router, depths = run(False)
    assert log == off_log
    router.deferral.fold()
    assert state(router) == state(off)
    assert depths and max(depths) == 0, depths  # multi-row steps: nothing left queued
    _, _, depths = run(True)
    assert max(depths) >= 1, depths  # the rule before: a multi-row step's report queued


def test_a_lazy_firm_hold_follows_a_fading_draft_within_its_span():
    """The draft stops agreeing (alpha 0.8 -> 0.05): with deferred observations the firm stream,
    released by its hold's own trials of the pair (`HoldTrials`), shortens its draft to k <= 2
    within a span of step 69, where the firm hold released by the request's folded estimate
    (without deferral; removed by prune23) did on 1fe960b, deciding about once a span.
    Negative control: never releasing on trials (the line at -inf), it comes later."""
    down, decided = {}, {}
    for lazy in (True, "never"):
        router, sim = settled()
        if lazy == "never":
            keep = router.stream.keep

            def keep_no_release(*args, _keep=keep, _router=router):
                started = _keep(*args)
                if _router.stream.trials is not None:
                    _router.stream.trials.line = -1.0
                    _router.stream.trials.hit_line = -1.0
                return started
            router.stream.keep = keep_no_release
        events = len(router.events)
        plans = stream(router, sim, 200, alphas_after={("d1", "T"): 0.05}, switch_at=0)
        decided[lazy] = len(router.events) - events
        down[lazy] = next(i for i, p in enumerate(plans) if p.decisions[0].chain == ("d1", "T")
                          and p.decisions[0].k <= 2 and p.decisions[0].reason != "probe")
    span = router.config.stream_hold_steps
    assert down[True] <= 69 + span, down
    assert decided[True] <= 200 // 4 + 15, decided
    assert down["never"] > down[True], down


def test_a_lazy_firm_hold_folds_before_deciding_and_at_a_finish():
    """Held steps queue their reports; the decision that ends the hold folds them first, and a
    finished request's are folded before it is forgotten."""
    router, sim = settled()
    seen = []
    for _ in range(12):
        stream(router, sim, 1)
        seen.append(len(router.deferral.queue))
    assert max(seen) >= 2, seen  # a hold's steps queued together
    assert 0 in seen or 1 in seen, seen  # ... and folded by the decision that ends it
    steps = router.observed_steps
    router.finish_request(0)
    assert not router.deferral.queue and router.observed_steps == steps


def test_the_comparison_sees_a_fold_out_of_order(monkeypatch):
    """Negative control of the exactness test: a fold that folds the queued reports last first
    (a firm hold's steps out of order) plans and ends knowing something else."""
    from specrouter.router.deferred import Deferral

    fold = Deferral.fold

    def reversed_fold(self):
        self.queue.reverse()
        fold(self)
    monkeypatch.setattr(Deferral, "fold", reversed_fold)
    off_log, off = scripted(False, 4)
    on_log, on = scripted(True, 4)
    on.deferral.fold()
    assert state(on) != state(off)
    assert repr(on_log) != repr(off_log)


def test_a_firm_hold_on_a_lookup_chain_learns_its_realized_check_as_without(monkeypatch):
    """review22 D2: with the draft model made slow (50 ms a forward), single streams run the
    n-gram chain, whose realized check (`Router._observe_realized`) each firm-hold step feeds
    through the fold's restored pending plan: the scripted run (seed 1) ends with the same
    realized sums and corrections, every request's, as without deferral, and some finished
    request has them. Negative control: a fold that forgets the queued steps' pending plans
    ends knowing something else."""
    import test_planner_memo

    from specrouter.router.deferred import Deferral

    monkeypatch.setitem(test_planner_memo.COSTS, "d1", lambda b, t, L: 0.05 + 0.001 * b * t)
    _, off = scripted(False, 4)
    _, on = scripted(True, 4)
    on.deferral.fold()
    assert state(on) == state(off)
    assert on.deferral.folded >= 20 and any(sums for _, sums, _ in off.realized_log), off.realized_log

    fold = Deferral.fold

    def forgetful(self):
        for item in self.queue:
            item.pending = dict.fromkeys(item.pending)
        fold(self)
    monkeypatch.setattr(Deferral, "fold", forgetful)
    _, forgot = scripted(True, 4)
    forgot.deferral.fold()
    assert state(forgot) != state(off)


def test_a_report_whose_fold_raises_loses_its_evidence_only(monkeypatch, caplog):
    """A queued report whose fold raises is logged ('evidence lost', as engine/isolation.py
    `_report` logs an observe_step that raises), the reports after it are folded, the fold
    returns normally and the planning's state is restored (the observed-step count; the row's
    cycle count less the lost report's, as an observe_step that raised would have left it).
    Negative control: the guard re-raising (the fold as it was) leaves the reports after the
    failing one unfolded, and the error escapes."""
    import logging

    from specrouter.router import deferred

    def queued():
        router, sim = settled()
        while len(router.deferral.queue) < 3:
            stream(router, sim, 1)
        fold, bad, done = router.deferral.fold_step, router.deferral.queue[1].report, []

        def failing(r, report):
            if report is bad:
                raise RuntimeError("boom")
            fold(r, report)
            done.append(report)
        router.deferral.fold_step = failing
        return router, [item.report for item in router.deferral.queue], done

    router, reports, done = queued()
    steps, cycles = router.observed_steps, router.requests[0].cycles
    with caplog.at_level(logging.ERROR, logger="specrouter.router.deferred"):
        router.deferral.fold()
    assert "its evidence is lost" in caplog.text
    assert done == [reports[0]] + reports[2:] and not router.deferral.queue
    assert router.observed_steps == steps and router.requests[0].cycles == cycles - 1

    router, reports, done = queued()
    steps = router.observed_steps

    def reraise(*args, **kwargs):
        raise RuntimeError("unguarded")
    monkeypatch.setattr(deferred.logger, "exception", reraise)
    with pytest.raises(RuntimeError):
        router.deferral.fold()
    assert done == [reports[0]] and router.observed_steps == steps
