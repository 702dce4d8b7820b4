"""The router's decision cache (router/evidence.py, issue 14): a row's PlanTable is reused while
its key (b, context bucket, mode, k cap, chain, evidence versions) holds; the evidence is
republished only on a material change. Scripted pool and virtual clock of test_router.py."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
from test_router import ALPHAS, L0, ORDER4, Sim, make_router, observe_cycle, true_plan

from specrouter.config import RouterConfig
from specrouter.router.evidence import CacheStats
from specrouter.router.policy import RowContext

LENGTH = 300  # tokens a simulated request generates before a new one takes its row


def run_steps(router, sim, steps, rows=4, trace=None, first_id=0):
    """Engine-like steps: plan_batch over every row (growing contexts, k capped by the remaining
    tokens), each plan group played by the simulator and observed, n-gram shadow scores, finished
    requests released and replaced."""
    lens = {first_id + s: L0 + 40 * s for s in range(rows)}
    next_id = first_id + rows
    for _ in range(steps):
        contexts = [RowContext(s, L, batch_size=len(lens), remaining=L0 + LENGTH - L) for s, L in lens.items()]
        decisions = router.plan_batch(contexts).decisions
        if trace is not None:
            trace.append(decisions)
        groups = defaultdict(list)
        for c, d in zip(contexts, decisions):
            groups[(d.chain, d.k)].append(c.seq_id)
        for (chain, k), members in groups.items():
            L = sum(lens[s] for s in members) // len(members)
            stats, outcomes, fwd, committed = sim.run(chain, k, members, L)
            observe_cycle(router, stats, outcomes, fwd)
            for s, n in zip(members, committed):
                if chain[0] != "ngram":
                    proposal, com = sim.shadow(s, 16, n)
                    router.observe_shadow(s, "ngram", proposal, com, 16)
                lens[s] += n
        for s in [s for s, L in lens.items() if L >= L0 + LENGTH - 1]:
            router.finish_request(s)
            del lens[s]
            lens[next_id], next_id = L0, next_id + 1
    return lens


@pytest.mark.parametrize("refute_wait", [0, 32])
def test_cached_decisions_equal_uncached_ones_while_evidence_changes(refute_wait):
    """Same world, same seeds: a router with the cache and one without decide exactly alike
    (chain, k, predicted T_eff, reason, confidence floor; probes included) through a 3x slowdown,
    a change of acceptance and request turnover. With the refuting probe's back-off
    (`probe_refute_wait`, router/probing.py) this world's decisions take another path that shows
    no probe decision; without it one shows, decided alike by both."""
    # the 4-row margin this world was built with (0.10; `BatchPlanner.plain_margin` asks it for
    # each row beside the first since load25): its 4-row batches speculate and probe
    config = RouterConfig(probe_refute_wait=refute_wait, batch_plain_margin=0.10 / 3)
    routers = {on: with_cache(make_router(config=config), on) for on in (True, False)}
    traces = {}
    for on, router in routers.items():
        sim = Sim(ALPHAS, seed=21)
        trace = traces[on] = []
        run_steps(router, sim, 150, trace=trace)
        sim.slow["d2"] = 3.0  # the middle level slows down
        run_steps(router, sim, 150, trace=trace, first_id=1000)
        sim.alphas[("d1", "T")] = 0.3  # and d1 drafts much worse
        sim.per_request[2001] = {"hit": 0.9, "alphas": {("ngram", "T"): 0.9, ("ngram", "d1"): 0.9}}
        run_steps(router, sim, 150, trace=trace, first_id=2000)
    assert traces[True] == traces[False]
    cached, uncached = routers[True], routers[False]
    assert [(e.seq_id, e.chain, e.k, e.reason, e.t_eff, e.best_t_eff, e.plain_t_eff) for e in cached.events] == \
        [(e.seq_id, e.chain, e.k, e.reason, e.t_eff, e.best_t_eff, e.plain_t_eff) for e in uncached.events]
    reasons = {d.reason for step in traces[True] for d in step}
    assert refute_wait or "probe" in reasons  # exploration runs on its own schedule, cache or not
    assert len({(d.chain, d.k) for step in traces[True] for d in step}) > 3  # decisions did change
    assert uncached.cache_stats.hits == 0
    assert cached.cache_stats.hit_rate > 0.5, cached.cache_stats
    print(f"\ncache hit rate {cached.cache_stats.hit_rate:.2f} over {len(cached.events)} decisions, "
          f"{cached.board.published.version} publications")


@pytest.mark.parametrize("rows", [1, 8])
def test_the_cache_hit_rate_is_high_in_steady_state(rows):
    """Long requests at a steady context bucket: only material moves of the evidence (and the
    refresh every decision_refresh steps) cost a recomputation."""
    router, sim, contexts = _warm(rows=rows, steps=100)
    router.cache_stats = CacheStats()
    _steps(router, sim, contexts, 300)
    stats = router.cache_stats
    print(f"\nb={rows}: steady-state hit rate {stats.hit_rate:.3f} ({stats.misses} misses)")
    assert stats.hit_rate > 0.9


def test_growing_requests_still_hit_mostly():
    """Engine-like: contexts grow through buckets, k caps near the end, requests turn over.
    Every row decided every step (spec_hold_steps=1): a speculative hold skips the decisions
    that would hit (294 misses with it, 309 without)."""
    sim = Sim(ALPHAS, seed=22)
    # its 8-row batches speculate at the 8-row margin this world was built with (0.10, before
    # load25's margin for each row beside the first): a plain hold would skip the decisions
    router = make_router(config=RouterConfig(spec_hold_steps=1, batch_plain_margin=0.10 / 7))
    lens = run_steps(router, sim, 100, rows=8)
    router.cache_stats = CacheStats()
    run_steps(router, sim, 300, rows=8, first_id=max(lens) + 1)
    stats = router.cache_stats
    print(f"\nb=8, growing requests: hit rate {stats.hit_rate:.3f} ({stats.misses} misses)")
    assert stats.hit_rate > 0.6


def _steps(router, sim, contexts, steps):
    """`steps` decide + observe cycles of fixed rows (one cycle per plan group)."""
    for _ in range(steps):
        decisions = [router.decide(c) for c in contexts]
        groups = defaultdict(list)
        for c, d in zip(contexts, decisions):
            groups[(d.chain, d.k)].append(c.seq_id)
        for (chain, k), members in groups.items():
            stats, outcomes, fwd, _ = sim.run(chain, k, members, L0)
            observe_cycle(router, stats, outcomes, fwd)


def with_cache(router, on: bool):
    """`router` as built (the decision cache on), or the uncached reference (off): every decision
    computes its PlanTable afresh, on the same published evidence (no request's table, no chain
    rows kept between decisions: what `RouterConfig.decision_cache=False` did before decide24)."""
    if not on:
        router.board.rows_for = lambda row, seconds: None
        decide = router.decide

        def uncached(row):
            req = router.requests.get(row.seq_id)
            if req is not None:
                req.cached = None
            return decide(row)

        router.decide = uncached
    return router


def _warm(rows=4, seed=23, steps=200):
    """A router after `steps` cycles of `rows` long requests at context L0."""
    sim = Sim(ALPHAS, seed=seed)
    router = make_router()
    contexts = [RowContext(s, L0, batch_size=rows) for s in range(rows)]
    _steps(router, sim, contexts, steps)
    return router, sim, contexts


def test_a_slowdown_invalidates_cached_decisions_at_once():
    router, sim, contexts = _warm()
    fast, slow = true_plan(ORDER4, ALPHAS), true_plan(ORDER4, ALPHAS, slow={"d2": 3.0})
    hits = router.cache_stats.hits
    assert all(router.decide(c).chain == fast.chain for c in contexts)
    assert router.cache_stats.hits == hits + len(contexts)  # nothing moved: every row hits
    version = router.board.published.version
    sim.slow["d2"] = 3.0
    for _ in range(2):  # the profile's step detector fires on the second slow observation
        stats, outcomes, fwd, _ = sim.run(fast.chain, fast.k, [c.seq_id for c in contexts], L0)
        observe_cycle(router, stats, outcomes, fwd)
    router.deferral.fold()  # deferred observations (lean20's default) are folded where read
    assert router.profile.jumps.get("d2") == 1
    misses = router.cache_stats.misses
    uncached = with_cache(copy.deepcopy(router), False)
    decisions = [router.decide(c) for c in contexts]
    assert router.board.published.version > version
    assert router.cache_stats.misses == misses + len(contexts)  # no row reused a stale plan
    assert decisions == [uncached.decide(c) for c in contexts]
    assert any(d.chain == slow.chain and d.reason != "probe" for d in decisions), decisions


def test_a_failed_model_invalidates_cached_decisions_and_is_never_planned_again():
    router, sim, contexts = _warm()
    assert all("d2" in router.decide(c).chain for c in contexts)
    uncached = with_cache(copy.deepcopy(router), False)
    router.mark_failed("T")  # the target cannot be taken out: ignored
    assert router.failed == set()
    for r in (router, uncached):
        r.mark_failed("d2")
    misses = router.cache_stats.misses
    trace = {id(r): [] for r in (router, uncached)}
    for r in (router, uncached):
        run = copy.deepcopy(sim)
        for _ in range(300):
            decisions = [r.decide(c) for c in contexts]
            trace[id(r)].append(decisions)
            for c, d in zip(contexts, decisions):
                stats, outcomes, fwd, _ = run.run(d.chain, d.k, [c.seq_id], L0)
                observe_cycle(r, stats, outcomes, fwd)
        if r is router:
            assert router.cache_stats.misses >= misses + len(contexts)
    decided = [d for step in trace[id(router)] for d in step]
    assert all("d2" not in d.chain for d in decided)
    assert decided[0].chain == true_plan(["ngram", "d1", "T"], ALPHAS).chain
    assert trace[id(router)] == trace[id(uncached)]


def test_decision_cache_settings_are_checked():
    for bad in ({"decision_tolerance": -0.1}, {"decision_time_tolerance": -1.0}, {"decision_refresh": 0}):
        with pytest.raises(ValueError):
            RouterConfig(**bad)


def test_a_switch_between_viable_chains_keeps_the_cached_table():
    """The request's chain is in the key only where pruning would drop it from the table: after
    a switch between two viable chains (decided on new evidence: one miss), the next decision on
    the same evidence reuses that table (it was a second miss, the key's chain alone changed)
    and decides exactly what an uncached router decides."""
    from specrouter.router.similarity import GREEDY

    routers = {on: with_cache(make_router(), on) for on in (True, False)}
    trace = {}
    for on, router in routers.items():
        for pair, a in ALPHAS.items():
            router.similarity.observe_acceptance(pair, GREEDY, 200 * a, 200 * (1 - a))
        router.similarity.observe_hits("ngram", 30, 100)
        row = RowContext(1, L0)
        first = router.decide(row)
        for pair in [p for p in ALPHAS if first.chain[-2:] == p or p in zip(first.chain, first.chain[1:])]:
            router.similarity.observe_acceptance(pair, GREEDY, 50, 1000)  # the plan's pairs accept ~5% now (viable)
        second = router.decide(row)
        assert second.chain != first.chain and second.reason == "better", (first, second)
        before = router.cache_stats.hits
        third = router.decide(row)
        trace[on] = [(d.chain, d.k, d.t_eff, d.reason) for d in (first, second, third)]
        if on:
            assert router.cache_stats.hits == before + 1, router.cache_stats
            assert "chain" not in router.cache_stats.reasons
    assert trace[True] == trace[False]


def test_a_request_whose_own_estimate_moved_re_evaluates_only_the_chains_reading_it(monkeypatch):
    """A request's own n-gram evidence moves (a miss: its evidence version changed): only the
    chains drafted by the n-gram are evaluated again; the model chains keep their rows from the
    last table (same costs, same estimates), and the decision equals an uncached router's."""
    from specrouter.router import policy
    from specrouter.router.similarity import GREEDY

    evaluated = []
    real = policy.chain_rows

    def counting(candidates, *args, **kwargs):
        evaluated.append([tuple(c) for c in candidates])
        return real(candidates, *args, **kwargs)

    monkeypatch.setattr(policy, "chain_rows", counting)
    decisions = {}
    for on in (True, False):
        router = with_cache(make_router(), on)
        for pair, a in ALPHAS.items():
            router.similarity.observe_acceptance(pair, GREEDY, 200 * a, 200 * (1 - a))
        router.similarity.observe_hits("ngram", 30, 100)
        row = RowContext(1, L0)
        first = router.decide(row)
        evaluated.clear()
        for _ in range(2):  # the request's own n-gram lookups hit and match 8 of 8
            router.observe_shadow(1, "ngram", list(range(8)), list(range(8)), 8)
        second = router.decide(row)
        decisions[on] = [(d.chain, d.k, d.t_eff, d.reason) for d in (first, second)]
        chains = {c for batch in evaluated for c in batch}
        if on:
            assert router.cache_stats.misses == 2 and router.cache_stats.reasons.get("request_version") == 1
            assert chains and all(c[0] == "ngram" for c in chains), (evaluated, router.board.publications)
        else:
            assert any(c[0] != "ngram" and len(c) > 1 for c in chains)
    assert decisions[True] == decisions[False]
