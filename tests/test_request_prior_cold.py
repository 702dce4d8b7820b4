"""A new request's prior for a model pair after a request boundary (first26, docs/router.md):
the global alpha then is the last requests' tail. While it rests on thin evidence and fewer than
`request_min_finished` finished requests reached an alpha of the pair, the pair's cold prior
stands in for their quantile, so a request after one that refuted the draft still tries it
(the mixed stream at t=0.7: after an extraction request whose draft accepted 0.04, the first
prose request began on model-free chains and never measured its own draft)."""

from __future__ import annotations

import pytest

from test_router import make_router

from specrouter.router.policy import RowContext, Router
from specrouter.router.similarity import GREEDY, SAMPLING

ORDER3 = ["ngram", "d1", "T"]
PAIR = ("d1", "T")


def old_prior(self, pair, mode, glob=None):
    """main's rule before first26: the global alpha until the finished requests' quantile."""
    glob = self.similarity.alpha(pair, mode) if glob is None else glob
    if pair[0] in self.model_free:
        return glob
    edge = self.finished.quantile(pair, mode)
    return glob if edge is None else max(glob, edge)


def after_a_refuting_request(mode=SAMPLING, draft_trials=(1.0, 29.0)):
    """Request 0 ran d1>T and the draft was refuted (thin global evidence, low); its n-gram had
    hits and accepted (an extraction request's tail); it finished."""
    router = make_router(ORDER3)
    sim = router.similarity
    req = router.request(0, mode == GREEDY)
    sim.observe_acceptance(PAIR, mode, *draft_trials)
    req.counts[PAIR] = list(draft_trials)
    sim.observe_acceptance(("ngram", "T"), mode, 20.0, 10.0)
    sim.observe_hits("ngram", 10, 20)
    router.finish_request(0)
    return router


@pytest.mark.parametrize("mode", [SAMPLING, GREEDY])
def test_after_a_refuting_request_the_next_one_tries_the_draft(mode, monkeypatch):
    router = after_a_refuting_request(mode)
    glob, source = router.similarity.alpha_detail(PAIR, mode)
    cold = router.similarity.prior(PAIR)
    assert source != "observed" and glob < 0.2 < cold
    assert router.request_prior(PAIR, mode) == cold
    first = router.decide(RowContext(1, 256, greedy=mode == GREEDY))
    assert "d1" in first.chain, first
    # negative control: the old rule (the thin global as the prior) starts it without the draft
    old = after_a_refuting_request(mode)
    monkeypatch.setattr(Router, "request_prior", old_prior)
    assert old.request_prior(PAIR, mode) == pytest.approx(glob)
    assert "d1" not in old.decide(RowContext(1, 256, greedy=mode == GREEDY)).chain


def test_the_cold_prior_stands_in_only_after_a_boundary_and_on_thin_evidence():
    # no request finished: the global is the running requests' own evidence
    router = make_router(ORDER3)
    router.similarity.observe_acceptance(PAIR, SAMPLING, 1.0, 29.0)
    assert router.request_prior(PAIR, SAMPLING) == router.similarity.alpha(PAIR, SAMPLING)
    # a global on enough trials (min_evidence) is kept, boundary or not
    router = after_a_refuting_request(draft_trials=(10.0, 290.0))
    assert router.similarity.alpha_detail(PAIR, SAMPLING)[1] == "observed"
    assert router.request_prior(PAIR, SAMPLING) == router.similarity.alpha(PAIR, SAMPLING)
    # model-free drafters keep the global alpha
    router = after_a_refuting_request()
    assert router.request_prior(("ngram", "T"), SAMPLING) == router.similarity.alpha(("ngram", "T"), SAMPLING)
    # a global above the cold prior is kept
    router = after_a_refuting_request(draft_trials=(29.0, 1.0))
    assert router.request_prior(PAIR, SAMPLING) == router.similarity.alpha(PAIR, SAMPLING) > router.similarity.prior(PAIR)
