"""`SimilarityEstimator.alpha_detail`'s memo (decide23) returns what a fresh computation returns:
after every kind of observation, every pair's and triple's alpha in both modes equals that of a
copy whose memo is empty (`__setstate__` clears it). Negative control: a memo that misses one of
its invalidations (the mode's calibration, a triple's pair) is caught by the same check."""

from __future__ import annotations

import copy
import random

import pytest

from specrouter.router.similarity import GREEDY, MODES, SAMPLING, SimilarityEstimator

SIZES = {"d": 10_000_000, "T": 400_000_000}
KEYS = [("d", "T"), ("n", "T"), ("n", "d"), ("n", "d", "T")]
PAIRS = KEYS[:3]


def observations(seed: int, steps: int = 300):
    """A seeded sequence of every kind of observation the router makes."""
    rng = random.Random(seed)
    for _ in range(steps):
        kind = rng.randrange(5)
        mode = rng.choice(MODES)
        key = rng.choice(KEYS)
        if kind == 0:  # trials with the row's own SimScore (teach the calibration, date the drift)
            yield "observe_acceptance", (key, mode, rng.randrange(4), rng.randrange(2), rng.uniform(0.5, 1.0))
        elif kind == 1:  # trials without one
            yield "observe_acceptance", (key, mode, rng.randrange(4), rng.randrange(2))
        elif kind == 2:  # a D_TV of a model pair
            yield "observe_tv", (("d", "T"), mode, rng.uniform(0.0, 0.6), rng.randrange(1, 17))
        elif kind == 3:
            yield "observe_hits", ("n", rng.randrange(2), 1)
        else:
            yield "touch", (rng.choice(PAIRS), mode)


def mismatches(est: SimilarityEstimator, seed: int) -> int:
    """Observations after which some memoized alpha differed from a fresh one."""
    bad = 0
    for name, args in observations(seed):
        getattr(est, name)(*args)
        for key in KEYS:  # the memo filled in this order, as the evidence snapshot fills it
            for mode in (GREEDY, SAMPLING):
                est.alpha(key, mode)
        fresh = copy.deepcopy(est)  # unpickled: its memo empty
        bad += any(est.alpha_detail(k, m) != fresh.alpha_detail(k, m) for k in KEYS for m in MODES)
    return bad


@pytest.mark.parametrize("seed", range(3))
def test_memoized_alphas_equal_fresh_ones(seed):
    est = SimilarityEstimator(SIZES, {"n"})
    assert mismatches(est, seed) == 0
    assert est._alphas, "the memo was used"


@pytest.mark.parametrize("forgotten", ["mode", "pair"])
def test_a_memo_missing_an_invalidation_is_caught(forgotten):
    """Negative control: the calibration's change not recorded for the mode, or a triple kept
    when its pair moved: the check above finds stale alphas."""

    class Forgetful(SimilarityEstimator):
        def observe_acceptance(self, pair, mode, accepted, rejections, sim=None):
            before = dict(self._changed)
            super().observe_acceptance(pair, mode, accepted, rejections, sim)
            if forgotten == "mode" and mode in before:
                self._changed[mode] = before[mode]
            elif forgotten == "mode":
                self._changed.pop(mode, None)

        def alpha_detail(self, pair, mode):
            if forgotten == "pair" and len(pair) == 3:  # a triple checked against its own counts only
                key = (tuple(pair), mode)
                hit = self._alphas.get(key)
                if hit is not None and max(self._changed.get(key, -1), self._changed.get(mode, -1)) <= hit[1]:
                    return hit[0]
                value = self._alpha_detail(key[0], mode)
                self._alphas[key] = (value, self.version)
                return value
            return super().alpha_detail(pair, mode)

    assert sum(mismatches(Forgetful(SIZES, {"n"}), seed) for seed in range(3)) > 0
