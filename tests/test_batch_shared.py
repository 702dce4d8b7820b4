"""The batch planner under load (router/batch.py, defer21): the shared-draft joint option
(`RouterConfig.batch_shared_ks`: every row on one model draft > target at k, one batched draft
forward for all) and a failed try of speculation weighed by its evidence
(`RouterConfig.batch_failed_min_steps`)."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine_batching import calibration_target, run_calibrated, scripted_router
from test_planner_memo import build_router

from specrouter.config import RouterConfig
from specrouter.records.routing import Decision
from specrouter.router.policy import Router, RowContext


def lookup_minded(router: Router, monkeypatch) -> None:
    """Each row decided alone picks the n-gram chain at k=4 (as rows of the serving bench mostly
    pick a model-free chain), its PlanTable as decide() made it (the planner's expected tokens)."""
    decide = Router.decide

    def decide_lookup(self, row):
        d = decide(self, row)
        return Decision(("ngram", "T"), 4, d.t_eff, "better")
    monkeypatch.setattr(Router, "decide", decide_lookup)


def rows(n: int, remaining: int | None = 48) -> list[RowContext]:
    return [RowContext(seq_id=i, context_len=200, batch_size=n, greedy=True, remaining=remaining) for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_the_shared_draft_is_weighed_where_rows_alone_pick_lookups(monkeypatch, n):
    """test_planner_memo's world (the target's forward steep in rows x tokens, d1 > T accepts
    75%, the n-gram drafter hits 40%): rows that each pick n-gram > T k=4 alone are planned, with
    the shared option, all on d1 > T at k=1 (one batched d1 forward; predicted faster than every
    option built from the rows' own plans and than plain batching by the margin). Negative
    control: without it (the default) no row runs d1."""
    def plan(ks):
        router = build_router()
        router.config = dataclasses.replace(router.config, batch_shared_ks=ks)
        lookup_minded(router, monkeypatch)
        out = router.plan_batch(rows(n)).decisions
        monkeypatch.undo()
        return out, router

    shared, router = plan((1, 2))
    assert all(d.chain == ("d1", "T") and d.k in (1, 2) and d.reason == "batch" for d in shared), shared
    plain = router.planner.step_seconds([(("T",), 0)] * n, 200)
    spec = router.planner.step_seconds([(d.chain, d.k) for d in shared], 200)
    tokens = sum(router.planner.expected_tokens(router.requests[i], d.chain, d.k) for i, d in enumerate(shared))
    assert tokens / spec > n / plain * (1 + router.config.batch_plain_margin)
    alone, _ = plan(())
    assert not any(d.chain[0] == "d1" for d in alone), alone


def test_the_shared_options_skip_failed_and_model_free_drafters_and_price_the_catch_up_over_the_rows_left():
    """One option per model drafter in service and k; its catch-up span is the fewest cycles a
    row has left at its expected tokens, between spec_hold_steps and plain_hold_max."""
    router = build_router()
    router.config = dataclasses.replace(router.config, batch_shared_ks=(1, 2))
    rs = rows(2, remaining=6)
    for r in rs:
        router.decide(r)
    reqs = [router.requests[r.seq_id] for r in rs]
    opts = router.planner.shared_options(rs, reqs)
    assert [(p[0], len(p)) for p, _ in opts] == [((("d1", "T"), 1), 2), ((("d1", "T"), 2), 2)]
    for (plans, span), k in zip(opts, (1, 2)):
        tokens = router.planner.expected_tokens(reqs[0], ("d1", "T"), k)
        assert span == max(router.config.spec_hold_steps, -(-6 // tokens))
    long = router.planner.shared_options(rows(2, remaining=None), reqs)
    assert all(span == router.config.plain_hold_max for _, span in long)
    router.mark_failed("d1")
    assert router.planner.shared_options(rs, reqs) == []
    assert router.planner.shared_options(rs[:1], reqs[:1]) == []  # a single stream: its own decision


def test_bad_shared_ks_and_failed_weight_are_refused():
    with pytest.raises(ValueError, match="batch_shared_ks"):
        RouterConfig(batch_shared_ks=(0,))
    with pytest.raises(ValueError, match="batch_shared_ks"):
        RouterConfig(batch_shared_ks=(RouterConfig().k_max + 1,))
    with pytest.raises(ValueError, match="batch_failed_min_steps"):
        RouterConfig(batch_failed_min_steps=-1)


def test_a_short_failed_try_is_weighed_by_its_evidence():
    """A 2-row batch whose speculation realises half its predicted rate. With
    `batch_failed_min_steps` 6, the first try (4 steps: two speculative holds) is too little
    evidence to stand for the run: it ages, speculation is tried again, and once the tries that
    lost in a row ran 6 steps the verdict stands (no try after that over 700 steps). Negative
    control: the default (any try) stands after the first one."""
    def tries(chosen):
        return [i for i, spec in enumerate(chosen) if spec and (i == 0 or not chosen[i - 1])]

    def run(steps):
        router = scripted_router(calibration_target)
        router.config = dataclasses.replace(router.config, batch_failed_min_steps=steps)
        return run_calibrated(router, 2.0, 700), router

    first, router = run(0)
    assert tries(first) == [0] and sum(first) < 6, first[:8]
    weighed, router = run(6)
    assert len(tries(weighed)) == 2, tries(weighed)
    assert sum(weighed) >= 6 and sum(weighed) <= 12, sum(weighed)
    cal = router.planner.calibrations[(2, True, False)]
    assert cal.failed and cal.lost_steps >= 6


def run_host(router, steps, host_ratio, n=2):
    """`steps` steps of n rows through plan_batch / observe_step on a step clock: the executor's
    wall at the planner's predicted seconds, committing the predicted tokens; a speculative
    step's host work outside the executor `host_ratio` times its wall (a plain step's none).
    Whether each speculated."""
    from specrouter.records.routing import RowOutcome, StepReport

    now = [0.0]
    router.step_clock = lambda: now[0]
    chosen = []
    for _ in range(steps):
        rs = rows(n, remaining=None)
        plans = [(d.chain, d.k) for d in router.plan_batch(rs).decisions]
        outcomes = []
        for r, (c, k) in zip(rs, plans):
            accepted = max(0, round(router.planner.expected_tokens(router.requests.get(r.seq_id), c, k)) - 1)
            outcomes.append(RowOutcome(r.seq_id, c, k, [k] * len(c), [0] + [accepted] * (len(c) - 1), True,
                                       r.context_len))
        spec = any(k > 0 for _, k in plans)
        wall = router.planner.step_seconds(plans, 200)
        now[0] += wall * (1.0 + (host_ratio if spec else 0.0))
        router.observe_step(StepReport(outcomes, [], wall, wall, spec))
        chosen.append(spec)
    return chosen


def test_the_calibration_counts_a_speculative_steps_host_work_outside_the_executor():
    """A 2-row batch whose speculative steps run as predicted in the executor but take as long
    again outside it (planning, observing, shadows: the engine's step, not the executor's):
    with `batch_calibration_host` the calibration sees the whole step (realised ~half the
    predicted rate) and the batch turns plain; at no host work it keeps speculating. Negative
    control: without it (the default) the calibration reads the executor's wall only and the
    batch speculates throughout."""
    def run(host, ratio):
        router = scripted_router(calibration_target)
        router.config = dataclasses.replace(router.config, batch_calibration_host=host)
        return run_host(router, 60, ratio), router

    counted, router = run(True, 1.0)
    assert counted[0] and not any(counted[20:]), counted
    factor = router.planner.calibrations[(2, True, False)].factor(router.config.batch_calibration_prior)
    assert factor < 0.75, factor
    assert all(run(True, 0.0)[0])
    assert all(run(False, 1.0)[0])


def run_versus_plain(router, ratio: float, steps: int) -> list[bool]:
    """`steps` planned 2-row steps (as `run_calibrated`) whose speculative steps realise `ratio`
    times plain batching's predicted rate (their seconds set by the tokens they commit), plain
    steps as predicted; whether each speculated."""
    from test_engine_batching import rows_of

    from specrouter.records.routing import RowOutcome

    chosen = []
    plain = 2 / router.planner.step_seconds([(("target",), 0)] * 2, 200)
    for _ in range(steps):
        rows = rows_of(2)
        plans = [(d.chain, d.k) for d in router.plan_batch(rows).decisions]
        outcomes, tokens = [], 0
        for r, (c, k) in zip(rows, plans):
            accepted = max(0, round(router.planner.expected_tokens(router.requests.get(r.seq_id), c, k)) - 1)
            tokens += accepted + 1 if k > 0 else 1
            outcomes.append(RowOutcome(r.seq_id, c, k, [k] * len(c), [0] + [accepted] * (len(c) - 1), True,
                                       r.context_len))
        spec = any(k > 0 for _, k in plans)
        seconds = tokens / (ratio * plain) if spec else router.planner.step_seconds(plans, 200)
        router.planner.observe(outcomes, [], seconds)
        router.observed_steps += 1
        chosen.append(spec)
    return chosen


@pytest.mark.parametrize("against", [False, True])
def test_a_try_that_beat_plain_batching_is_not_found_failed_against_plain(against):
    """A 2-row batch whose speculation is predicted ~1.8x plain batching and realises 1.02x:
    calibrated, the plan no longer clears the plain margin, so the try ends. The default verdict
    finds it failed (short of its prediction by the margin): no try again over 700 steps.
    Against plain (`batch_failed_against_plain`) it did not lose, so its evidence ages and
    speculation is tried again. Where speculation realises 0.8x plain, both verdicts find it
    failed (one try)."""
    def tries(chosen):
        return [i for i, spec in enumerate(chosen) if spec and (i == 0 or not chosen[i - 1])]

    def run(ratio):
        router = scripted_router(calibration_target)
        router.config = dataclasses.replace(router.config, batch_failed_against_plain=against)
        return run_versus_plain(router, ratio, 700), router

    won, router = run(1.02)
    assert (len(tries(won)) >= 3) == against, tries(won)
    assert router.planner.calibrations[(2, True, False)].failed != against
    if not against:
        assert sum(won) < 50, sum(won)  # the first try only
    lost, router = run(0.8)
    assert tries(lost) == [0] and router.planner.calibrations[(2, True, False)].failed
