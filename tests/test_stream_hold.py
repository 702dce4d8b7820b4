"""A single stream's hold (router/stream_hold.py, issue 31): a decided speculative plan (a firm
hold) or a plain plan kept by hysteresis is kept `stream_hold_steps` steps without decide(),
released early by what would change the decision. Scripted pool and virtual clock of
test_router.py. (The speculative hold released by the request's evidence moving, and the firm
hold released by its folded estimate, were removed by prune23, issue 27: their tests went with
them; negative controls that need an unfirm hold install one by hand.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from test_router import ALPHAS, HOLD4, L0, Sim, make_router, observe_cycle

from specrouter.config import RouterConfig
from specrouter.router.policy import Decision, RowContext
from specrouter.router.stream_hold import StreamHolder

STRONG = {**ALPHAS, ("d1", "T"): 0.8}  # d1 > T wins clearly: the stream settles on it


def stream(router, sim, steps, seq_id=0, remaining=None, alphas_after=None, switch_at=None):
    """`steps` engine steps of one row through plan_batch, each played by the simulator and
    observed; `alphas_after` replaces the simulator's acceptances from step `switch_at` on.
    Returns the BatchPlans."""
    plans = []
    for i in range(steps):
        if switch_at is not None and i == switch_at:
            sim.alphas.update(alphas_after)
        row = RowContext(seq_id, L0, remaining=None if remaining is None else remaining - i)
        batch = router.plan_batch([row])
        plans.append(batch)
        d = batch.decisions[0]
        stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [seq_id], L0)
        observe_cycle(router, stats, outcomes, fwd)
    return plans


def settled(steps=60, **config):
    """A router whose single stream settled on a speculative plan under a firm hold (4-step
    spans unless asked otherwise; its deferred observations are test_deferred.py's)."""
    for name, value in HOLD4.items():
        config.setdefault(name, value)
    router = make_router(order=["ngram", "d1", "T"], config=RouterConfig(**config))
    sim = Sim(STRONG, seed=3)
    stream(router, sim, steps)
    return router, sim


def test_a_held_plan_is_what_the_decision_would_be():
    """Same world, same seed: with the hold and without it, the stream runs the same plans
    (chain, k) in every step where the unheld router decided "same" (a settled stream gains
    nothing from deciding again)."""
    runs = {}
    for h in (4, 1):
        router = make_router(order=["d1", "T"], config=RouterConfig(stream_hold_steps=h))
        sim = Sim(STRONG, seed=5)
        runs[h] = [(p.decisions[0].chain, p.decisions[0].k) for p in stream(router, sim, 150)]
    assert runs[4][40:] == runs[1][40:]  # settled from early on: every cycle the same plan


def _fresh_hold(router, sim, row=None):
    """Step the stream until a hold has just started (its first held step is next)."""
    for _ in range(20):
        events = len(router.events)
        if row is None:
            stream(router, sim, 1)
        else:
            d = router.plan_batch([row]).decisions[0]
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [row.seq_id], L0)
            observe_cycle(router, stats, outcomes, fwd)
        if len(router.events) > events and router.stream.hold is not None:
            return router.stream.hold
    raise AssertionError("no hold started")


@pytest.mark.parametrize("release", ["version", "joined", "other-row", "pinned", "jump", "probe", "failed"])
def test_what_would_change_the_decision_releases_a_plain_hold(release):
    """A plain plan kept by hysteresis is held (not firm); each release ends it: the next step
    is decided (a DecisionEvent), not held. The control: the same router, the same row, is
    held."""
    router, _ = plain_kept(0.115, 0)
    sim = Sim({**STRONG, ("d1", "T"): 0.115}, seed=3)
    row = RowContext(0, L0)
    hold = _fresh_hold(router, sim, row)
    assert not hold.firm and hold.decision.chain == ("T",)
    rows, pinned = [row], []
    if release == "version":
        router.requests[0].version += 1
    elif release == "joined":
        rows = [dataclasses.replace(row, batch_size=2), RowContext(1, L0, batch_size=2)]
    elif release == "other-row":
        rows = [RowContext(7, L0)]
    elif release == "pinned":
        pinned = [(("T",), 0)]
    elif release == "jump":
        router.profile.jumps["T"] = router.profile.jumps.get("T", 0) + 1
    elif release == "probe":
        router.prober.next_check = 0
        router.prober.budget = copy.deepcopy(router.prober.budget)
        router.prober.budget.allow = lambda: True
    elif release == "failed":
        router.mark_failed("d1")
    control = copy.deepcopy(router)
    events = len(router.events)
    router.plan_batch(rows, pinned)
    assert router.stream.hold is None or router.stream.hold is not hold
    assert len(router.events) > events
    if release in ("version", "jump", "probe", "failed"):
        return  # the state itself released it (control shares it)
    events, held = len(control.events), control.stream.held
    control.plan_batch([row])
    assert len(control.events) == events and control.stream.held == held + 1


def test_held_cycles_feed_the_realized_check():
    """A held cycle is compared with the prediction it was decided at: the request's pending
    plan is set on every held step (the realized check consumes it each observed cycle)."""
    router, sim = settled()
    router.prober.next_check = 10 ** 9  # no probe due
    req, held = router.requests[0], 0
    for _ in range(40):
        before = router.stream.held
        d = router.plan_batch([RowContext(0, L0)]).decisions[0]
        if router.stream.held > before:
            held += 1
            assert req.pending == router.stream.hold.pending is not None
        stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0)
        observe_cycle(router, stats, outcomes, fwd)
        assert req.pending is None  # consumed by the observation
    assert held >= 20


def test_config_validates_stream_hold_steps():
    with pytest.raises(ValueError, match="stream_hold_steps"):
        RouterConfig(stream_hold_steps=0)


def test_a_hold_kept_by_hysteresis_counts_its_cycles_toward_patience():
    """A plan kept by hysteresis while predicted slower than the best (counting toward
    `patience`): each held cycle counts as a repeat of that decision, and the hold ends in time
    for the decision that switches ("persistent") at the cycle it would without the hold.
    Negative control: a hold that does not count keeps the plan past patience."""
    router, sim = settled()
    hold = _fresh_hold(router, sim)
    req = router.requests[0]
    patience = router.config.patience
    for counts in (True, False):
        r = copy.deepcopy(router)
        rq = r.requests[0]
        r.stream.hold = dataclasses.replace(hold, counts=counts, until=r.observed_steps + 100)
        rq.worse = patience - 3
        r.prober.next_check = 10 ** 9  # no probe due
        held = []
        for _ in range(4):
            before = r.stream.held
            r.plan_batch([RowContext(0, L0)])
            held.append(r.stream.held > before)
            d = r.stream.hold.decision if r.stream.hold is not None else r.events[-1]
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0)
            observe_cycle(r, stats, outcomes, fwd)
        if counts:
            assert held[:2] == [True, True] and not held[2], held  # worse: p-2, p-1, then decided
        else:
            assert all(held) and rq.worse == patience - 3
    assert req.worse < patience


def plain_kept(alpha, steps, **config):
    """A single stream on plain decoding where d1 > T is predicted faster by less than
    `switch_margin` (the pair's evidence fixed at `alpha`, no probe due): plain decoding is kept
    by hysteresis. Returns (router, the BatchPlans)."""
    router = make_router(order=["d1", "T"], config=RouterConfig(**config))
    router.similarity.observe_acceptance(("d1", "T"), "greedy", 1000 * alpha, 1000 * (1 - alpha))
    req = router.request(0, True)
    req.plan, req.epoch = (("T",), 0), (0,)
    router.prober.next_check = 10 ** 9
    return router, stream(router, Sim({**STRONG, ("d1", "T"): alpha}, seed=3), steps)


def test_a_plain_plan_kept_by_hysteresis_is_held():
    """Plain decoding kept by hysteresis (d1 > T predicted faster by under `persist_margin`, so
    no patience runs) is held like a kept speculative plan: decided about once per
    `stream_hold_steps`, its held steps plain and counted as held (the outside clock learns
    plain decoding's cost from them). It was decided every step (chat with penalties on the Zen
    1: 19 such steps in a request at +1-2 ms each). Negative control: no plain plan held (as
    `stream_hold_plain=False` was, removed by prune23) decides every step."""
    router, plans = plain_kept(0.115, 100)
    reasons = {e.reason for e in router.events}
    assert reasons == {"hysteresis"}, reasons  # the world this test means: plain kept by hysteresis
    held = [p for p in plans if p.decisions[0].reason == "held"]
    assert len(held) >= 70 and len(router.events) <= 30, (len(held), len(router.events))
    assert all(p.held and p.decisions[0].chain == ("T",) for p in held)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamHolder, "PLAIN_KEPT", ())
        control, plans = plain_kept(0.115, 100)
    assert len(control.events) == 100 and control.stream.held == 0


def test_a_plain_hold_kept_by_hysteresis_switches_when_patience_runs_out(monkeypatch):
    """d1 > T predicted faster than plain decoding by more than `persist_margin` (less than
    `switch_margin`): plain decoding is kept by hysteresis `patience` decisions, then left
    ("persistent"). Held, its cycles count toward patience, and it leaves at the same step as
    the unheld control (no plain plan held, as `stream_hold_plain=False` was), after fewer
    decisions."""
    first = {}
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(StreamHolder, "PLAIN_KEPT", ())
        router, plans = plain_kept(0.14, 40)
        switch = next(i for i, p in enumerate(plans) if p.decisions[0].chain != ("T",))
        assert router.events[0].reason == "hysteresis"
        first[kept] = (switch, sum(e.step <= switch for e in router.events))
    (held_at, held_decided), (control_at, control_decided) = first.values()
    assert held_at == control_at
    assert held_decided < control_decided / 2, first


# -- the firm hold (lean18; on since lean20) ----------------------------------------------------


@pytest.mark.parametrize("release", ["version", "probe", "remaining", "jump", "other-row", "pinned", "refuted"])
def test_a_firm_hold_outlasts_its_requests_evidence_moving_and_a_due_probe(release):
    """A firm hold is kept while the request's evidence version moves and while a probe is due
    (it waits for the hold's end), and near the request's end its k is capped rather than the
    hold released; a row change, a pinned row, a model's speed jump or the plan's own pair
    refuted by its own trials (the pair's estimate fell by more than `decision_tolerance`) still
    release it.
    Negative control: the same moves release the same hold made not firm by hand (the first
    three; an unfirm speculative hold was `stream_hold_firm=False`, removed by prune23)."""
    from types import SimpleNamespace

    for firm in (True, False):
        router, sim = settled()
        hold = _fresh_hold(router, sim)
        assert hold.firm
        if not firm:
            router.stream.hold = hold = dataclasses.replace(
                hold, firm=False, watched=None, epoch=tuple(router.profile.jumps.get(m, 0) for m in hold.decision.chain))
        row, rows, pinned = RowContext(0, L0), None, []
        if release == "version":
            router.requests[0].version += 1
        elif release == "probe":
            router.prober.next_check = 0
            router.prober.budget = copy.deepcopy(router.prober.budget)
            router.prober.budget.allow = lambda: True
        elif release == "remaining":
            row = dataclasses.replace(row, remaining=hold.decision.k)  # one token short of k + 1
        elif release == "jump":
            router.profile.jumps["d1"] = router.profile.jumps.get("d1", 0) + 1
        elif release == "other-row":
            row = RowContext(7, L0)
        elif release == "pinned":
            pinned = [(("T",), 0)]
        elif release == "refuted":  # trials of the pair rejected: the hold's count, the request's
            k, pair = hold.decision.k, hold.decision.chain[:2]
            for _ in range(10):
                router.stream.tally(SimpleNamespace(forwards=[], outcomes=[SimpleNamespace(
                    seq_id=0, chain=hold.decision.chain, k=k, drafted=[k, k], accepted=[0, 0])]))
            req = router.requests[0]
            req.observe(pair, 0.0, 40.0, router.config.request_decay)
            req.note(pair, "greedy")
        events = len(router.events)
        batch = router.plan_batch(rows or [row], pinned)
        kept = len(router.events) == events
        if firm and release in ("version", "probe", "remaining"):
            assert kept and router.stream.hold is hold
            d = batch.decisions[0]
            assert d.reason == "held" and d.chain == hold.decision.chain
            assert d.k == (hold.decision.k - 1 if release == "remaining" else hold.decision.k)
        else:
            assert not kept and router.stream.hold is not hold, (firm, release)


def test_a_firm_stream_is_decided_once_per_hold_and_shadows_on_its_last_step_only():
    """Under a firm hold a settled stream is decided once per `stream_hold_steps` steps (a
    switch starts a hold too), and shadow proposals run on each hold's last step only: the
    decided step that starts a hold has none. Negative control: no hold (stream_hold_steps=1)
    decides and shadows every step."""
    counts = {}
    for firm in (True, False):
        router, sim = settled(stream_hold_steps=4 if firm else 1)
        router.prober.next_check = 10 ** 9  # no probe due
        events = len(router.events)
        plans = stream(router, sim, 200)
        decided = len(router.events) - events
        shadowed = sum(p.shadow_k > 0 for p in plans)
        counts[firm] = (decided, shadowed)
        if firm:
            assert 200 // 4 - 2 <= decided <= 200 // 4 + 2, decided
            for p, nxt in zip(plans, plans[1:]):
                if p.decisions[0].reason != "held":  # a decided step that started a hold
                    assert p.shadow_k == 0 and nxt.decisions[0].reason == "held"
            assert shadowed <= decided + 1
    assert counts[True][0] < counts[False][0] and counts[True][1] < counts[False][1], counts


def test_a_firm_holds_refutation_compares_like_with_like():
    """review19 R1: a sampled request's published alpha is its estimate less the decision
    margin (0.07 at alpha 0.4 with 4 own trials); a firm hold compared the raw estimate with it,
    so it was released only once the pair fell by 0.12, not by `decision_tolerance` (0.05).
    Both sides now carry the margin (`EvidenceBoard.alpha`; the hold's own trials,
    `HoldTrials.estimate`, as the request's folded estimate reads them): three rejections (raw
    0.40 -> 0.32, margined 0.329 -> 0.26) refute it, as they move the request's version. Negative controls: one rejection (raw 0.369) does
    not, and the raw estimate after three stays above the old line (published - tolerance)."""
    from types import SimpleNamespace

    from specrouter.router.similarity import SAMPLING

    pair = ("d1", "T")
    for rejections, refuted in ((3, True), (1, False)):
        router = make_router(order=["d1", "T"], config=RouterConfig(probe_fraction=0.0))
        router.similarity.observe_acceptance(pair, SAMPLING, 4e5, 6e5)
        req = router.request(1, False)
        req.counts[pair] = [1.6, 2.4]
        start = router.alpha(pair, SAMPLING, req)
        assert start == pytest.approx(0.4, abs=0.002)
        published = router.board.request_evidence(req, SAMPLING).alphas[pair]
        assert start - published > 0.06  # the margin (z 0.5, 12 trials)
        row = RowContext(1, L0, greedy=False)
        assert router.stream.keep([row], [], Decision(pair, 2, 0.01, "same"), req, router.observed_steps)
        for _ in range(rejections):
            router.stream.tally(SimpleNamespace(forwards=[], outcomes=[SimpleNamespace(
                seq_id=1, chain=pair, k=2, drafted=[2, 2], accepted=[0, 0])]))
            req.observe(pair, 0.0, 1.0, router.config.request_decay)  # the fold's, for the raw value
            req.note(pair, SAMPLING)
        raw = router.alpha(pair, SAMPLING, req)
        assert start - raw < start - published + router.config.decision_tolerance  # the old line: kept
        assert router.stream.trials.estimate() == pytest.approx(router.board.alpha(req, pair, SAMPLING))
        assert router.stream.trials.refuted() == refuted, (rejections, start, raw, published)
        probe = copy.deepcopy(req)
        probe.settle(router.board)
        assert (probe.version != req.version) == refuted  # the same line as the version's move
