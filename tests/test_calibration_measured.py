"""The similarity -> acceptance calibration learns only from trials that came with their row's own
measured SimScore (router/similarity.py `observe_acceptance`; review18's risk 2): trials of a step
the TvSchedule skipped count as acceptance evidence but teach the calibration nothing (the pair's
global SimScore as the row's stand-in was `SimilarityConfig.calibrate_stand_in`, removed by prune22)."""

from __future__ import annotations

import pytest

from specrouter.config import SimilarityConfig
from specrouter.router.similarity import SAMPLING, SimilarityEstimator

PAIR = ("draft", "target")


def estimator(**kw):
    est = SimilarityEstimator(sizes={"draft": 1, "target": 10}, config=SimilarityConfig(**kw))
    est.observe_tv(PAIR, SAMPLING, 0.3, 16)  # the pair's global SimScore (0.7) is known
    return est


def test_unmeasured_trials_count_but_do_not_teach_the_calibration():
    est = estimator()
    est.observe_acceptance(PAIR, SAMPLING, 3, 1)  # a step without D_TV
    cal = est.calibrations[SAMPLING]
    assert cal.sw == 0 and est.stats(PAIR, SAMPLING).accepted == 3
    est.observe_acceptance(PAIR, SAMPLING, 5, 1, sim=0.9)  # a measured one teaches it
    assert cal.sw == pytest.approx(6) and cal.sy == pytest.approx(5)

