"""`SimilarityEstimator.alpha_detail`'s memo (decide23) returns what a fresh computation returns:
after every kind of observation, every pair's and triple's alpha in both modes equals that of a
copy whose memo is empty (`__setstate__` clears it), the transitive fallback included (d2 > T
through d: D_TVs of (d, T) and (d2, d), none of its own). Negative control: a memo that misses
one of its invalidations (the mode's calibration, a triple's pair, a D_TV's mode-wide one) is
caught by the same check."""

from __future__ import annotations

import copy
import random

import pytest

from specrouter.router.similarity import GREEDY, MODES, SAMPLING, SimilarityEstimator

SIZES = {"d": 10_000_000, "d2": 40_000_000, "T": 400_000_000}
KEYS = [("d", "T"), ("d2", "T"), ("d2", "d"), ("n", "T"), ("n", "d"), ("n", "d", "T")]
PAIRS = KEYS[:5]
MEASURED = [("d", "T"), ("d2", "d")]  # model pairs with D_TVs: (d2, T) reads them transitively


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
            yield "observe_tv", (rng.choice(MEASURED), mode, rng.uniform(0.0, 0.6), rng.randrange(1, 17))
        elif kind == 3:
            yield "observe_hits", ("n", rng.randrange(2), 1)
        else:
            yield "touch", (rng.choice(PAIRS), mode)


def mismatches(est: SimilarityEstimator, seed: int, sources: set | None = None) -> int:
    """Observations after which some memoized alpha differed from a fresh one (`sources`:
    collects the fallbacks the fresh alphas read)."""
    bad = 0
    for name, args in observations(seed):
        getattr(est, name)(*args)
        for key in KEYS:  # the memo filled in this order, as the evidence snapshot fills it
            for mode in (GREEDY, SAMPLING):
                est.alpha(key, mode)
        fresh = copy.deepcopy(est)  # unpickled: its memo empty
        details = {(k, m): fresh.alpha_detail(k, m) for k in KEYS for m in MODES}
        bad += any(est.alpha_detail(k, m) != d for (k, m), d in details.items())
        if sources is not None:  # the fallbacks the fresh alphas read (alone or blended with counts)
            sources.update((k, fresh.fallback(k, m)[1]) for (k, m), d in details.items() if d[1] != "observed")
    return bad


@pytest.mark.parametrize("seed", range(3))
def test_memoized_alphas_equal_fresh_ones(seed):
    est = SimilarityEstimator(SIZES, {"n"})
    sources = set()
    assert mismatches(est, seed, sources) == 0
    assert est._alphas, "the memo was used"
    assert {(("d2", "T"), "transitive"), (("d", "T"), "similarity")} <= sources  # every fallback reached


@pytest.mark.parametrize("forgotten", ["mode", "pair", "tv"])
def test_a_memo_missing_an_invalidation_is_caught(forgotten):
    """Negative control: the calibration's change not recorded for the mode, a triple kept
    when its pair moved, or a D_TV recorded for its own pair only (the transitive fallback
    of another pair that reads it left stale): the check above finds stale alphas."""

    class Forgetful(SimilarityEstimator):
        def observe_tv(self, pair, mode, tv, positions):
            before = self._changed.get(mode)
            super().observe_tv(pair, mode, tv, positions)
            if forgotten == "tv" and before is not None:
                self._changed[mode] = before
            elif forgotten == "tv":
                self._changed.pop(mode, None)

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
