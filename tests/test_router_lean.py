"""The router's own host seconds per step (issues 27, 28, 31, lean18): model-free drafters'
timings batched into the cost profile, the similarity estimator's alphas memoized per version,
a request's estimate checks deferred to where its version is read. Scripted pool of
test_router.py."""

from __future__ import annotations

import math
import random

from test_router import make_router

from specrouter.config import RouterConfig
from specrouter.records.routing import ForwardRecord
from specrouter.router.policy import observe_forwards
from specrouter.router.similarity import GREEDY, SimilarityEstimator


def test_model_free_timings_reach_the_profile_in_batches_and_jump_less():
    """With `free_timing_batch` 16 a model-free drafter's forwards reach the cost profile 16 at a
    time (their seconds summed: one observation), a model's each time; under the same noisy
    timings (a lookup of ~30 us, +-60%) its step detector fires less often than one at a time
    (the negative control, batch 1), and the speed it learns is the same within 10%."""
    out = {}
    for batch in (1, 16):
        router = make_router(order=["ngram", "d1", "T"], config=RouterConfig(free_timing_batch=batch))
        base = router.profile.predict("ngram", 1, 8, 256)
        rng = random.Random(7)
        before = router.profile._models["ngram"].observations, router.profile._models["T"].observations
        for _ in range(320):
            observe_forwards(router, [ForwardRecord("ngram", 1, 8, 256, base * 1.5 * math.exp(rng.gauss(0, 0.5))),
                                      ForwardRecord("T", 1, 1, 256, router.profile.predict("T", 1, 1, 256))])
        ngram, target = (router.profile._models[m].observations - b for m, b in zip(("ngram", "T"), before))
        assert target == 320 and ngram == 320 // batch, (batch, ngram, target)
        out[batch] = (router.profile.jumps.get("ngram", 0), router.profile.speed("ngram"))
    assert out[16][0] < out[1][0], out
    assert abs(math.log(out[16][1] / out[1][1])) < 0.1, out


def test_a_memoized_alpha_is_the_alpha_of_the_evidence_now():
    """`SimilarityEstimator.alpha` is memoized per version: every observation (acceptance, D_TV,
    hits) gives the value computed afresh from the new evidence, transitive fallbacks included."""
    sim = SimilarityEstimator({"d1": 10, "d2": 30, "T": 100})
    pairs = [("d1", "T"), ("d2", "T"), ("d1", "d2")]
    for step, observe in enumerate([
        lambda: sim.observe_tv(("d1", "d2"), GREEDY, 0.2, 8),
        lambda: sim.observe_tv(("d2", "T"), GREEDY, 0.3, 8),
        lambda: sim.observe_acceptance(("d1", "T"), GREEDY, 3, 1, 0.7),
        lambda: sim.observe_acceptance(("d2", "T"), GREEDY, 1, 1),
        lambda: sim.observe_acceptance(("d1", "d2"), GREEDY, 0, 3),
    ]):
        cached = {p: sim.alpha(p, GREEDY) for p in pairs}
        observe()
        fresh = {p: sim._alpha_detail(p, GREEDY)[0] for p in pairs}
        assert {p: sim.alpha(p, GREEDY) for p in pairs} == fresh
        assert fresh != cached or step == 0, step  # the memo did not hand back the old values


def test_a_requests_estimates_are_checked_where_its_version_is_read():
    """Observing a cycle notes the request's updated estimates (`RequestState.note`) without
    checking them; `settle` (at its next decision, or a hold's check) gives it a new version
    when one moved materially, as checking at every observation did."""
    router = make_router(order=["ngram", "d1", "T"])
    req = router.request(0, True)
    router.board.request_evidence(req, GREEDY)  # published: moves are measured from it
    version = req.version
    req.observe(("d1", "T"), 0.0, 20.0, router.config.request_decay)  # its draft refuted 20 times
    req.note(("d1", "T"), GREEDY)
    assert req.version == version and req.notes
    req.settle(router.board)
    assert req.version == version + 1 and not req.notes
    req.note(("d1", "T"), GREEDY)  # noted again, moved no further since published? it did: published is old
    req.settle(router.board)
    assert req.version == version + 2
    router.board.request_evidence(req, GREEDY)  # republished at this version
    req.note(("d1", "T"), GREEDY)
    req.settle(router.board)
    assert req.version == version + 2  # nothing moved since
