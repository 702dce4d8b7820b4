"""A probe judged by what it showed (router/probing.py `Prober.judge`, issue 31's chat fix): a
probe whose pair accepted no more than the request's estimate keeps that pair from the
request's probes for `probe_refute_wait` of its cycles, doubling. Scripted pool and virtual
clock of test_router.py."""

from __future__ import annotations

from test_router import L0, Sim, make_router, observe_cycle

from specrouter.config import RouterConfig
from specrouter.router.policy import RowContext, RowOutcome

PAIR = ("d2", "T")


def probe_stream(requests, **config):
    """Single-stream requests decided every cycle over a draft that agrees on 3% of tokens in
    every request (`requests`: cycles of each, in turn): plain decoding is the plan, and the
    pair's thin evidence keeps it worth a probe. Returns (the router, per request the cycles
    at which it was probed)."""
    router = make_router(order=["d2", "T"], timer=lambda: 0.0, config=RouterConfig(**config))
    sim = Sim({PAIR: 0.03}, seed=3)
    probed = []
    for seq_id, cycles in enumerate(requests):
        probed.append([])
        for i in range(cycles):
            d = router.decide(RowContext(seq_id, L0))
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [seq_id], L0)
            observe_cycle(router, stats, outcomes, fwd)
            if d.reason == "probe":
                probed[-1].append(i)
        router.finish_request(seq_id)
    return router, probed


def test_refuted_probes_back_the_pair_off_for_the_request():
    """One long request: every probe of the draft refutes the optimism that chose it, so the
    request waits 32, 64, 128, ... of its cycles between them. Negative control
    (`probe_refute_wait=0`): a model pair's probe always adds a trial, so the old back-off never
    starts and the probes run as often as the budget allows."""
    _, (probed,) = probe_stream([1200])
    _, (control,) = probe_stream([1200], probe_refute_wait=0)
    print(f"\nprobes at {probed} against {len(control)} without the back-off")
    assert 3 <= len(probed) <= 7 and len(control) >= 3 * len(probed), (probed, len(control))
    gaps = [b - a for a, b in zip(probed, probed[1:])]
    # doubling; a probe that happened to accept (3%) sets no wait: the next may follow at once
    assert sum(g < 32 for g in gaps) <= 1 and gaps[-1] >= 8 * 32, gaps


def test_the_back_off_is_the_requests_own():
    """A new request is probed as the first was (its own wait starts empty): the back-off of a
    request that refuted the pair does not carry over."""
    _, probed = probe_stream([400, 100])
    assert probed[1] and probed[1][0] < 40, probed


def _outcome(chain, k, drafted, accepted):
    return RowOutcome(0, chain, k, drafted, accepted)


def test_judge_refutes_doubles_clears_and_skips():
    router = make_router(order=["ngram", "d2", "T"], timer=lambda: 0.0)
    req = router.request(0, True)
    prober, wait = router.prober, router.config.probe_refute_wait

    def judge(pair, estimate, outcome):
        prober.testing[0] = (pair, estimate)
        prober.judge(req, outcome)

    judge(PAIR, 0.3, _outcome(PAIR, 2, [2, 2], [0, 0]))  # 0 of 1 trial accepted: refuted
    assert req.probe_waits[PAIR] == (req.cycles + wait, wait)
    req.cycles += 5
    judge(PAIR, 0.3, _outcome(PAIR, 4, [4, 4], [0, 1]))  # 1 accepted, 1 rejection: 0.5 > 0.3
    assert req.probe_waits[PAIR] == (req.cycles - 5 + wait, wait)  # no new wait
    judge(PAIR, 0.3, _outcome(PAIR, 1, [1, 1], [0, 0]))  # refuted again: doubled
    assert req.probe_waits[PAIR] == (req.cycles + 2 * wait, 2 * wait)
    judge(("ngram", "T"), 0.2, _outcome(("T",), 4, [0, 0], [0, 0]))  # a model-free miss: no trial
    assert ("ngram", "T") not in req.probe_waits and not prober.testing
    judge(("ngram", "T"), 0.2, _outcome(("ngram", "T"), 4, [3, 3], [0, 1]))  # 1 of 4 asked: 1 / 2 trials
    assert ("ngram", "T") not in req.probe_waits

