"""Decisions read a request's estimates less a margin of their own uncertainty
(`RouterConfig.decision_margin_sampling` / `_greedy`, router/evidence.py `decision_margin`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_router import L0, make_router

from specrouter.config import RouterConfig
from specrouter.router.evidence import decision_margin, own_trials
from specrouter.router.policy import RowContext
from specrouter.router.similarity import GREEDY, SAMPLING

PAIR = ("d1", "T")


def test_the_margin_is_z_standard_errors_and_shrinks_with_evidence():
    assert decision_margin(0.3, 8, 0.0) == 0.3
    assert decision_margin(0.3, 8, 1.0) == pytest.approx(0.3 - math.sqrt(0.21 / 8))
    assert decision_margin(0.05, 1, 2.0) == 0.0  # never below 0
    assert decision_margin(1.0, 8, 1.0) == 1.0  # a certain estimate keeps its value
    assert decision_margin(0.3, 800, 1.0) > decision_margin(0.3, 80, 1.0) > decision_margin(0.3, 8, 1.0)


def test_a_requests_alphas_and_hit_rates_are_read_less_the_modes_margin():
    cfg = RouterConfig(decision_margin_sampling=1.0)
    router = make_router(["ngram", "d1", "T"], config=cfg)
    router.similarity.observe_acceptance(PAIR, SAMPLING, 300, 700)
    sampled, greedy = router.request(1, False), router.request(2, True)
    sampled.counts[PAIR] = [6.0, 14.0]
    n = own_trials(router, sampled, PAIR)
    assert n == pytest.approx(cfg.request_prior_strength + 20)
    mean = router.alpha(PAIR, SAMPLING, sampled)
    assert router.board.alpha(sampled, PAIR, SAMPLING) == pytest.approx(mean - math.sqrt(mean * (1 - mean) / n))
    # greedy decisions: no margin by default (it cost the greedy mixed stream 8%, floor19)
    assert router.board.alpha(greedy, PAIR, GREEDY) == router.alpha(PAIR, GREEDY, greedy)
    sampled.hits["ngram"] = [3.0, 10.0]
    h = router.hit_rate("ngram", sampled)
    assert router.board.hit_rate(sampled, "ngram") == pytest.approx(
        h - math.sqrt(h * (1 - h) / (10 + cfg.request_hit_prior_strength)))
    assert router.board.hit_rate(greedy, "ngram") == router.hit_rate("ngram", greedy)
    ev = router.board.request_evidence(sampled, SAMPLING)  # what decide() reads
    assert ev.alphas[PAIR] == pytest.approx(router.board.alpha(sampled, PAIR, SAMPLING), abs=1e-4)
    off = make_router(["ngram", "d1", "T"], config=RouterConfig(decision_margin_sampling=0.0))
    assert off.board.alpha(sampled, PAIR, SAMPLING) == off.alpha(PAIR, SAMPLING, sampled)


def _speculates(router, sid: int, alpha: float, own: float) -> bool:
    """A fresh sampled request with `own` trials of its own at `alpha` (the global estimate
    pinned there too): does its first decision speculate?"""
    router.similarity.observe_acceptance(PAIR, SAMPLING, 1e5 * alpha, 1e5 * (1 - alpha))
    req = router.request(sid, False)
    if own:
        req.counts[PAIR] = [own * alpha, own * (1 - alpha)]
    return router.decide(RowContext(sid, L0, greedy=False)).k > 0


def test_thin_evidence_near_break_even_decodes_plainly_and_enough_evidence_speculates():
    """Near the draft's break-even a new request with only its prior's evidence decodes plainly
    under the margin (the prior may be high by chance), where the router without one
    speculates; with its own evidence at the same alpha the margin is small and it speculates."""
    base = RouterConfig(probe_fraction=0.0, decision_margin_sampling=0.0)
    alphas = [i / 100 for i in range(5, 96)]
    edge = next(a for a in alphas if _speculates(make_router(["d1", "T"], config=base), 1, a, 0))
    a = edge + 0.04
    assert _speculates(make_router(["d1", "T"], config=base), 1, a, 0)
    margin = dataclasses.replace(base, decision_margin_sampling=1.0)
    assert not _speculates(make_router(["d1", "T"], config=margin), 1, a, 0)
    assert _speculates(make_router(["d1", "T"], config=margin), 1, a, 5000)


def test_margins_are_checked():
    with pytest.raises(ValueError):
        RouterConfig(decision_margin_sampling=-0.5)
    with pytest.raises(ValueError):
        RouterConfig(decision_margin_greedy=-1.0)


def test_the_default_takes_half_a_standard_error_off_sampled_requests_only():
    cfg = RouterConfig()
    assert cfg.decision_margin_sampling == 0.5 and cfg.decision_margin_greedy == 0.0
