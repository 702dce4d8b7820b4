"""The similarity signal measured for real (issue 27 item 1): the executor's D_TV at verified
positions against a reference computed from fresh forwards, the copy-of-the-target control, and
what the router learns from it (the request's own prior, drift before the counts see it)."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures import QuietRouterHooks, load_named_pool, repeating_prompts

from specrouter.config import SamplingParams
from specrouter.decoding.tv import tv_from_logits
from specrouter.engine.engine import Engine
from specrouter.models.runners.base import ForwardBatch
from specrouter.records.routing import Decision, RowOutcome, StepReport
from specrouter.router.policy import Router
from specrouter.router.similarity import GREEDY, SAMPLING, SimilarityEstimator

N = 12


class Recorder(QuietRouterHooks):
    """A fixed plan for every row; keeps every StepReport (with the rows' D_TV)."""

    def __init__(self, chain, k, measure_tv=True, tv_positions=16):
        self.plan, self.measure_tv, self.tv_positions, self.reports = (chain, k), measure_tv, tv_positions, []

    def decide(self, row):
        return Decision(*self.plan, t_eff=0.0, reason="fixed")

    def observe_step(self, report):
        self.reports.append(report)


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, ("target", "mid", "draft", "same"))  # + ngram, suffix


@pytest.fixture(scope="module")
def fresh(tiny_pool_dirs):
    """Runners of their own for reference forwards."""
    return load_named_pool(tiny_pool_dirs, ("target", "mid", "draft"), ngram=False, suffix=False).runners


def run(pool, chain, k, temperature=0.8, measure_tv=True, tv_positions=16):
    router = Recorder(chain, k, measure_tv, tv_positions)
    eng = Engine(pool.with_fresh_drafters(), router=router)
    cycles, steps = [], []  # CycleStats of each step (one per chain group)
    eng.on_cycle = cycles.append
    params = SamplingParams(temperature=temperature, max_new_tokens=N, ignore_eos=True, seed=3)
    eng.reserve(3, 64)
    seqs = [eng.add_request(p, params) for p in repeating_prompts((5, 9, 14))]
    while eng.has_unfinished():
        eng.step()
        steps.append(list(cycles))
        cycles.clear()
    return router.reports, steps, {s.seq_id: s for s in seqs}


def level_tvs(reports, j):
    """D_TV at level j of every row-cycle that passed candidates to it."""
    return [o.tv[j] for r in reports for o in r.outcomes if len(o.chain) > j and o.drafted[j]]


def logits_at(runner, tokens, positions):
    """A fresh forward's logits (len(positions), V) of `tokens` from position 0."""
    runner.reserve(1, 64)
    batch = ForwardBatch.build([0], [0], [list(tokens)], [list(positions)])
    return runner.forward(batch)[0]


@pytest.mark.parametrize("positions", [16, 1])
def test_tv_at_verified_positions_equals_a_fresh_forwards(pool, fresh, positions):
    """A sampled (t=0.8) draft > target row's D_TV is the temperature-0.8 D_TV of the two models'
    fresh forwards at the draft's positions (the proposal the row verified; its first
    `positions`), for every cycle."""
    reports, cycles, seqs = run(pool, ("draft", "target"), 4, temperature=0.8, tv_positions=positions)
    checked = 0
    for report, step in zip(reports, cycles, strict=True):
        props = {sid: p for c in step for sid, p in zip(c.row_ids, c.row_proposal)}
        for o in report.outcomes:
            if len(o.chain) == 1:  # the end of a request: plain decoding
                assert o.tv == [math.nan] or math.isnan(o.tv[0])
                continue
            n = o.drafted[1]
            if n == 0:
                assert math.isnan(o.tv[1])
                continue
            ctx = seqs[o.seq_id].tokens[: o.context_len]
            toks, pos = ctx + props[o.seq_id][: n - 1], range(len(ctx) - 1, len(ctx) - 1 + n)
            d, t = (logits_at(fresh[m], toks, pos)[None] for m in ("draft", "target"))
            mask = torch.arange(n)[None] < positions
            want = float(tv_from_logits(d, t, mask, temperature=0.8)[0])
            assert o.tv[1] == pytest.approx(want, abs=1e-5)
            assert math.isnan(o.tv[0])
            checked += 1
    tvs = level_tvs(reports, 1)
    assert checked == len(tvs) >= 6 and 0.02 < sum(tvs) / len(tvs) < 0.9
    assert sum(r.tv_seconds for r in reports) > 0


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_a_copy_of_the_target_has_no_distance_a_noisier_model_more(pool, temperature):
    """The negative control of alignment: the target's exact copy drafting is at D_TV ~ 0 at
    every position (one position off, it would not be); the mid model (10% weight noise) is
    closer to the target than the draft (40%); in a 3-level chain both levels are measured."""
    mean = {}
    for name in ("same", "mid", "draft"):
        tvs = level_tvs(run(pool, (name, "target"), 4, temperature)[0], 1)
        assert tvs
        mean[name] = sum(tvs) / len(tvs)
    assert mean["same"] < 1e-5 < mean["mid"] < mean["draft"] < 1.0
    reports = run(pool, ("mid", "draft", "target"), 4, temperature)[0]  # pool order: mid before draft
    assert level_tvs(reports, 1) and level_tvs(reports, 2)


def test_model_free_rows_and_measuring_off_have_no_tv(pool):
    reports, _, _ = run(pool, ("ngram", "target"), 4)
    assert all(math.isnan(x) for r in reports for o in r.outcomes for x in o.tv)
    reports, _, _ = run(pool, ("draft", "target"), 4, measure_tv=False)
    assert all(o.tv is None for r in reports for o in r.outcomes) and sum(r.tv_seconds for r in reports) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_greedy_rows_skip_the_measurement(pool, temperature):
    """The router reads no greedy row's D_TV (its `SimilarityConfig.greedy_tv` was removed by
    prune22, the executor's `tv_greedy_rows` after it): the executor neither keeps a greedy row's
    logits nor compares them (no measuring seconds), while sampled rows are measured."""
    reports = run(pool, ("draft", "target"), 4, temperature)[0]
    tvs = level_tvs(reports, 1)
    if temperature == 0.0:
        assert tvs and all(math.isnan(x) for x in tvs) and sum(r.tv_seconds for r in reports) == 0
    else:
        assert tvs and all(0.0 < x < 1.0 for x in tvs) and sum(r.tv_seconds for r in reports) > 0


def test_steps_report_their_draft_steps_and_host_seconds(pool):
    """Issue 33: a step tells the router its model draft steps after each drafter's first
    forward (k - 1 for a draft of k) and their host seconds outside forwards, a part of the
    step's host time; model-free drafts have none."""
    reports = run(pool, ("draft", "target"), 4)[0]
    full = [r for r in reports if all(o.k == 4 and o.drafted[0] == 4 for o in r.outcomes)]
    assert full and all(r.draft_steps == 3 for r in full)
    assert all(0.0 < r.draft_host_seconds < r.wall_time - r.forward_time for r in full)
    reports = run(pool, ("ngram", "target"), 4)[0]
    assert all(r.draft_steps == 0 and r.draft_host_seconds == 0.0 for r in reports)


def test_the_output_is_the_same_with_and_without_measuring(pool):
    """Measuring D_TV (sampled rows, seeded) changes no token."""
    _, _, on = run(pool, ("mid", "draft", "target"), 3)
    _, _, off = run(pool, ("mid", "draft", "target"), 3, measure_tv=False)
    assert [s.tokens for s in on.values()] == [s.tokens for s in off.values()]


# -- what the router learns -------------------------------------------------------------------


def feed(est, sim, alpha, trials, rng, pair=("d", "T"), mode=GREEDY):
    """`trials` one-row cycles of k=4 whose acceptance is iid `alpha` and whose D_TV is 1 - sim."""
    for _ in range(trials):
        a = 0
        while a < 4 and rng.random() < alpha:
            a += 1
        est.observe_tv(pair, mode, 1.0 - sim, 4)
        est.observe_acceptance(pair, mode, a, int(a < 4), sim)


@pytest.mark.parametrize("drift", [True, False])
def test_drift_shows_in_similarity_before_the_counts(drift, monkeypatch):
    """After 400 cycles at SimScore 0.9 / acceptance 0.85, the pair degrades to SimScore 0.6 /
    acceptance 0.4: 30 cycles later the estimate with drift has moved most of the way (the
    counts alone, the negative control: `drifted` returning the counts' value, as
    `SimilarityConfig.drift=False` did, a small part of it)."""
    import random

    if not drift:
        monkeypatch.setattr(SimilarityEstimator, "drifted", lambda self, s, pair, mode, observed: observed)
    rng = random.Random(0)
    est = SimilarityEstimator({"d": 10, "T": 100})
    feed(est, 0.9, 0.85, 400, rng)
    before = est.alpha(("d", "T"), GREEDY)
    feed(est, 0.6, 0.4, 30, rng)
    after = est.alpha(("d", "T"), GREEDY)
    moved = (before - after) / (before - 0.4)
    assert moved > 0.5 if drift else moved < 0.35, (before, after)


@pytest.mark.parametrize("greedy", [False, True])
def test_a_requests_own_similarity_is_its_prior(greedy):
    """Two new requests after one cycle each on the same pair, one at SimScore 0.95, one at 0.5,
    each with 2 of 4 accepted: the similar one's alpha is well above the other's (without
    measuring, both would sit at the same count-based estimate). Greedy rows' D_TV the router
    does not read (`greedy_tv`, off, was removed by prune22; docs/router.md): there both
    requests sit at the same estimate (the negative control)."""
    from test_router import make_router

    router = make_router()
    est = router.similarity
    mode = GREEDY if greedy else SAMPLING
    import random

    feed(est, 0.9, 0.8, 200, random.Random(1), pair=("d1", "T"), mode=mode)
    feed(est, 0.5, 0.35, 200, random.Random(2), pair=("d1", "T"), mode=mode)  # the calibration sees both regimes
    alphas = []
    for sid, tv in ((1, 0.05), (2, 0.5)):
        router.observe_step(StepReport([RowOutcome(sid, ("d1", "T"), 4, [4, 4], [0, 2], greedy, 100, [math.nan, tv])],
                                       [], 0.01, 0.009, True))
        router.deferral.fold()  # deferred observations (lean20's default) are folded where read
        alphas.append(router.alpha(("d1", "T"), mode, router.requests[sid]))
    if not greedy:
        assert alphas[0] > alphas[1] + 0.1, alphas
    else:
        assert alphas[0] == pytest.approx(alphas[1], abs=0.01), alphas  # (the global counts moved a little)
