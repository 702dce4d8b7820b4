"""Runs of agreement (router/burst.py, cost_model.py point 5: issue 27's k ramp)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from test_router import PER_STEP

from specrouter.config import RouterConfig
from specrouter.records.routing import ForwardRecord, RowContext, RowOutcome, StepReport
from specrouter.router.burst import BurstModel
from specrouter.router.cost_model import RUN, _schedule_transition, _transition, best_plan
from specrouter.router.policy import Router
from specrouter.router.profile import CostProfile
from specrouter.router.request_state import RequestState
from specrouter.router.similarity import GREEDY


def test_a_schedule_prices_each_candidate_after_the_ones_before_it():
    """E[accepted] of k candidates under schedule g is sum_i prod_{j < i} g_j (the last entry
    serving every later candidate); a constant schedule is the iid transition."""
    width = 20
    assert np.allclose(_schedule_transition((0.63,), width), _transition(0.63, width), atol=1e-15)
    g = (0.4, 0.5, 0.8, 0.9)
    costs = {"d": 0.001, "t": 0.01}
    plan = best_plan([("d", "t")], 10, costs=costs, alphas={("d", "t"): 0.5, ("d", "t", RUN): g})
    for k in range(1, 11):
        expected = 1.0 + sum(np.prod([g[min(j, 3)] for j in range(i)]) for i in range(1, k + 1))
        assert plan.table.expected_tokens[0, k - 1] == pytest.approx(expected, rel=1e-12)
    iid = best_plan([("d", "t")], 10, costs=costs, alphas={("d", "t"): 0.5})
    assert plan.k > iid.k  # the run's later candidates are worth drafting (negative control: iid)


def test_runs_are_counted_per_run_length_and_reset_by_a_rejection():
    model = BurstModel(RouterConfig(burst_max_run=3, burst_decay=1.0))
    pair = ("d", "t")
    assert model.observe(pair, GREEDY, 0, 4, 4) == 4  # all four accepted: the run grows by 4
    assert model.observe(pair, GREEDY, 4, 4, 1) == 0  # one accepted, then a rejection
    counts = model.counts[(pair, GREEDY)]
    # run 0, 1, 2: one accepted each; run >= 3: the first cycle's 4th (accepted), the second's
    # two (accepted, rejected)
    assert counts == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [2.0, 3.0]]
    req = RequestState(greedy=True)
    model.observe_row(req, ("d", "t"), 4, 4, 4, GREEDY, frozenset())
    assert req.runs == {pair: 4}  # a first cycle: its run starts, uncounted
    model.observe_row(req, ("t",), 0, 0, 0, GREEDY, frozenset())
    assert req.runs == {}  # a plain cycle: the draft did not judge its token


COSTS = {  # seconds of one forward (b rows, t new tokens, context L): as the default pool on a CPU,
    # verifying a few more tokens costs the target little, a draft step ~3% of its step
    "ngram": lambda b, t, L: 3e-5 * b,
    "d1": lambda b, t, L: 0.0003 * b + 1e-6 * b * t,
    "T": lambda b, t, L: 0.010 + 0.0003 * b * t + 1e-7 * L * b,
}


def markov_world(seed: int, burst: bool, cycles: int = 400) -> tuple[float, list[int]]:
    """A single stream whose draft agrees in runs (a two-regime world: 0.95 inside a run, 0.15
    outside, switching with probability 0.1 per token): (tokens per second, per speculative
    cycle (the draft's run of accepted tokens before it, its k))."""
    profile = CostProfile()
    for name, fn in COSTS.items():
        profile.set_function(name, fn, batch_sizes=(1, 2, 4, 8), new_tokens=(1, 2, 4, 8, 16, 24),
                             context_lengths=(128, 1024))
    clock = itertools.count()
    router = Router(list(COSTS), "T", profile, model_free={"ngram"}, timer=lambda: next(clock) * 1e-5,
                    config=RouterConfig(burst_acceptance=burst, **PER_STEP))  # a run prices the next cycle: decided each cycle
    router.similarity.observe_hits("ngram", 0, 100)
    rng = random.Random(seed)
    state, L, tokens, seconds, ks, run = True, 200, 0, 0.0, [], 0

    def agree() -> bool:
        nonlocal state
        if rng.random() < 0.1:
            state = not state
        return rng.random() < (0.95 if state else 0.15)

    for _ in range(cycles):
        d = router.plan_batch([RowContext(0, L)]).decisions[0]
        chain, k = d.chain, d.k
        if len(chain) == 1 or k == 0 or chain[0] == "ngram":  # plain, or an n-gram that finds nothing
            agree()  # the token the target writes (the draft's agreement there unseen)
            run = 0
            out = RowOutcome(0, chain, k, [0] * len(chain), [0] * len(chain), True, L)
            fwd = [ForwardRecord("T", 1, 1, L, COSTS["T"](1, 1, L))]
            n = 1
        else:
            a = 0
            while a < k and agree():
                a += 1
            out = RowOutcome(0, chain, k, [k, k], [0, a], True, L)
            fwd = [ForwardRecord(chain[0], 1, 1, L, COSTS[chain[0]](1, 1, L) * k, k),
                   ForwardRecord("T", 1, k + 1, L, COSTS["T"](1, k + 1, L))]
            n = a + 1
            ks.append((run, k))
            run = run + k if a == k else 0
        wall = sum(f.seconds for f in fwd)
        router.observe_step(StepReport([out], fwd, wall + 4e-4, wall, k > 0))
        tokens, seconds, L = tokens + n, seconds + wall + 4e-4, L + n
    return tokens / seconds, ks


def test_runs_of_agreement_ramp_k_at_once_and_do_not_lose_in_a_bursty_world():
    """The router with runs of agreement drafts longer the cycle after a run of full
    acceptances and shorter the cycle after a rejection (the iid twin, its negative control,
    drafts alike either way), and commits at least as many tokens per second as the twin on
    the same worlds (+0.4-1.2% in such worlds: the iid optimum already drafts long where
    drafting is cheap)."""
    on = [markov_world(s, True) for s in range(4)]
    off = [markov_world(s, False) for s in range(4)]
    rate_on, rate_off = sum(r for r, _ in on), sum(r for r, _ in off)
    assert rate_on >= rate_off, (rate_on, rate_off)

    def by_run(worlds):
        after_run = [k for _, ks in worlds for run, k in ks if run >= 4]
        after_miss = [k for _, ks in worlds for run, k in ks if run == 0]
        return np.mean(after_run), np.mean(after_miss)

    run_k, miss_k = by_run(on)
    assert run_k > miss_k + 2, (run_k, miss_k)
    iid_run_k, iid_miss_k = by_run(off)
    assert abs(iid_run_k - iid_miss_k) < 1, (iid_run_k, iid_miss_k)
