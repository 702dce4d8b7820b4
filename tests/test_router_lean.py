"""The router's own host seconds per step (issues 27, 28, 31, lean18): the similarity
estimator's alphas memoized per version, a request's estimate checks deferred to where its
version is read (model-free drafters' timings batched, `free_timing_batch`, was removed by
prune22). Scripted pool of test_router.py."""

from __future__ import annotations

from test_router import make_router

from specrouter.router.similarity import GREEDY, SimilarityEstimator


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
