"""A lone stream whose draft was refuted by its first cycles decodes plainly to its end (issues
27, 28: prose greedy settled plain on both requests while draft>target k=4 ran 1.34x target-only).
Two parts locked it: a probe of the draft after plain steps was vetoed by the catch-up check
(router/batch.py `BatchPlanner.alone` weighed it at the request's own estimate, the one the probe
questions), and the request's own evidence of the pair was frozen while it ran plain (nothing
tried the draft). Now a probe runs as decided (`BatchPlanner.alone`; the veto, `vetoing` below, was
`RouterConfig.probe_past_catch_up=False`, removed by prune23) and a pair's
request evidence fades per cycle that did not try it (`RouterConfig.request_idle_decay`).
A third lock: a draft read slow in a stalled cycle is priced out of every plan and never timed
again; the prober re-tries a model read slower than its usual speed after
`RouterConfig.probe_slow_after` row-cycles (it waited for the pair evidence's `stale_after`, 200).

Scripted pool and virtual clock of test_router.py, stepped through `plan_batch` as the engine
steps a single stream (holds, the catch-up check), the draft's lag growing a token per plain step."""

from __future__ import annotations

import dataclasses

from test_router import L0, Sim, make_router, observe_cycle

from specrouter.config import RouterConfig
from specrouter.router.policy import Decision, RowContext, fade_idle
from specrouter.router.stream_hold import StreamHolder

PAIR = ("d2", "T")
BEFORE = dict(veto_probes=True, request_idle_decay=1.0)  # main a28af27's behaviour (lock-in)
STALL = {"d2": 15.0, "T": 3.0}  # one engine step in a co-tenant's stall
LAZY8 = dict(stream_hold_steps=8)  # lean19's lazy8, the default since lean20 (firm holds, deferred observations)
PER_STEP = dict(stream_hold_steps=1)  # decided every step (the 4-step hold released by the request's
#                                        evidence, these tests' per-step router before, was removed by prune23)


def vetoing(router) -> None:
    """The catch-up check as before (main a28af27): a lone row's probe of a lagging draft
    weighed at the request's own estimate like any plan, so vetoed where that plan would be."""
    alone = router.planner.alone

    def veto(row, decision):
        if decision.reason != "probe":
            return alone(row, decision)
        checked = alone(row, dataclasses.replace(decision, reason="weighed"))
        return checked if checked.reason == "catch-up" else decision

    router.planner.alone = veto


def stream(first, then, refuted=10, cycles=160, seed=0, slow=lambda step: {}, veto_probes=False, **config):
    """One request of `cycles` engine steps: the draft agrees on `first` of the tokens for its
    first `refuted` steps, then on `then` (a draft's agreement comes in runs); `slow(step)`: the
    models' slowdown factors at that step; `veto_probes`: the catch-up check vetoes probes as
    before (`vetoing`). Returns (one character per step: "S" speculated, "." plain; tokens per
    virtual second)."""
    router = make_router(order=["d2", "T"], timer=lambda: 0.0, config=RouterConfig(**config))
    if veto_probes:
        vetoing(router)
    sim = Sim({PAIR: then}, seed=seed)
    steps, tokens, seconds, lag, left = [], 0, 0.0, 1, 4 * cycles
    for i in range(cycles):
        sim.per_request[0] = {"alphas": {PAIR: first if i < refuted else then}}
        sim.slow.clear()
        sim.slow.update(slow(i))
        row = RowContext(0, L0 + tokens, remaining=left, lags=(("d2", lag),), lags_generated=(("d2", lag - 1),))
        d = router.plan_batch([row]).decisions[0]
        stats, outcomes, fwd, committed = sim.run(d.chain, d.k, [0], L0 + tokens)
        # the executor reports a model draft's k steps one by one (the simulator: one record)
        fwd = [g for f in fwd for g in [dataclasses.replace(f, seconds=f.seconds / f.count, count=1)] * f.count]
        observe_cycle(router, stats, outcomes, fwd)
        lag = 1 if len(d.chain) > 1 else lag + 1  # the draft misses every plainly decoded token
        tokens, left, seconds = tokens + committed[0], left - committed[0], seconds + stats.wall_time
        steps.append("S" if len(d.chain) > 1 else ".")
    return "".join(steps), tokens / seconds


def test_a_stream_refuted_early_returns_to_its_draft():
    """The draft agrees on 5% of tokens for 10 steps, then on 90%: the router falls back to
    plain decoding within those 10 steps and speculates again within 20 steps of the change,
    ~1.8x the tokens per second. Negative control (main's behaviour): plain from the fallback to
    the request's end, 160 steps."""
    for seed in range(3):
        steps, rate = stream(0.05, 0.9, seed=seed)
        old_steps, old_rate = stream(0.05, 0.9, seed=seed, **BEFORE)
        print(f"\n{steps} {rate:.1f} tok/s\n{old_steps} {old_rate:.1f} tok/s (before)")
        assert "." in steps[:10] and steps[30:].count("S") >= 0.95 * len(steps[30:]), steps
        assert old_steps[10:] == "." * 150, old_steps
        assert rate > 1.6 * old_rate, (rate, old_rate)


def test_each_part_breaks_the_lock_alone():
    """A probe past the catch-up check (the idle fade off) brings the draft back at its first
    probe; the idle fade alone (probes vetoed as before) when the request's estimate is back
    near its prior, later."""
    probed, _ = stream(0.05, 0.9, request_idle_decay=1.0)
    faded, _ = stream(0.05, 0.9, veto_probes=True)
    print(f"\n{probed} (probes only)\n{faded} (fade only)")
    assert probed[40:].count("S") >= 0.95 * len(probed[40:]), probed
    assert faded[80:].count("S") >= 0.95 * len(faded[80:]), faded


def test_a_draft_that_stays_slow_stays_plain():
    """Negative control: a draft agreeing on 5% of tokens throughout is tried only by a few
    budgeted probes (at most 5% of the steps after the fallback) and the stream runs within 2%
    of main's rate, which never tries it again."""
    for seed in range(3):
        steps, rate = stream(0.05, 0.05, seed=seed)
        _, old_rate = stream(0.05, 0.05, seed=seed, **BEFORE)
        print(f"\n{steps} {rate:.2f} vs {old_rate:.2f} tok/s")
        assert steps[10:].count("S") <= 0.05 * len(steps[10:]), steps
        assert rate >= 0.98 * old_rate, (rate, old_rate)


def test_the_catch_up_check_lets_a_probe_run():
    """`BatchPlanner.alone`: a lone row whose draft lags 40 tokens, 3 tokens from its end, is
    kept plain when its own plan speculates (the catch-up does not pay) but runs a probe as
    decided; the old check (`vetoing`, the negative control) vetoes the probe too."""
    row = RowContext(0, L0, remaining=3, lags=(("d2", 40),), lags_generated=(("d2", 39),))
    for reason, veto, vetoed in (("same", False, True), ("probe", False, False), ("probe", True, True)):
        router = make_router(order=["d2", "T"], timer=lambda: 0.0)
        if veto:
            vetoing(router)
        router.request(0, True)
        d = router.planner.alone(row, Decision(PAIR, 2, 0.01, reason))
        assert (d.k == 0 and d.reason == "catch-up") == vetoed, (reason, veto, d)


def test_idle_cycles_fade_a_requests_own_model_pair_evidence():
    """A plain cycle fades the request's counts and D_TV of every model pair by
    `request_idle_decay`; a cycle that runs the pair, and a model-free drafter's pair (shadow
    proposals score it on plain cycles), do not fade; the request's estimate moves back toward
    its prior and its evidence version moves once that is material (checked where the version
    is read: `RequestState.settle`)."""
    router = make_router(order=["ngram", "d2", "T"], timer=lambda: 0.0)
    req = router.request(0, True)
    prior = router.alpha(PAIR, "greedy", req)
    req.counts[PAIR] = [0.0, 6.0]
    req.counts[("ngram", "T")] = [1.0, 3.0]
    req.tv[PAIR] = [3.0, 4.0]
    router.board.request_evidence(req, "greedy")  # published: the fade's moves are measured from it
    low, version = router.alpha(PAIR, "greedy", req), req.version
    fade_idle(router, req, PAIR, "greedy")  # the pair ran: nothing fades
    req.settle(router.board)
    assert req.counts[PAIR] == [0.0, 6.0] and req.version == version
    for _ in range(20):
        fade_idle(router, req, ("T",), "greedy")
    decay = router.config.request_idle_decay ** 20
    assert abs(req.counts[PAIR][1] - 6.0 * decay) < 1e-9 and abs(req.tv[PAIR][1] - 4.0 * decay) < 1e-9
    assert req.counts[("ngram", "T")] == [1.0, 3.0]
    req.settle(router.board)
    assert low < router.alpha(PAIR, "greedy", req) <= prior and req.version > version
    req.counts[PAIR] = [0.5, 0.0]  # accepted only: it fades too, and is dropped once negligible
    for _ in range(120):
        fade_idle(router, req, ("T",), "greedy")
    assert PAIR not in req.counts and PAIR not in req.tv and router.alpha(PAIR, "greedy", req) == prior


def test_a_draft_read_slow_in_a_stall_is_retried():
    """One stalled step (the draft 15x, the target 3x) while speculating on a draft agreeing on
    80%: the draft's speed jumps to 15 and the stream goes plain; a probe at its usual speed
    after `probe_slow_after` (16) row-cycles reads it anew and it speculates again, ~1.39x the
    tokens per second (~1.45x with the 4-step hold released by the request's evidence, removed
    by prune23). Negative control (`probe_slow_after=200`, main's wait): plain to the end."""
    stall = {20: STALL}
    # decided per step (PER_STEP): under lazy8 the stalled step, inside a firm hold, is folded with
    # the hold's later fast steps at its end and never prices the draft out (34.6 tok/s with and
    # without the retry: the lock this test breaks does not form)
    steps, rate = stream(0.8, 0.8, slow=lambda i: stall.get(i, {}), **PER_STEP)
    old_steps, old_rate = stream(0.8, 0.8, slow=lambda i: stall.get(i, {}), probe_slow_after=200, **PER_STEP)
    print(f"\n{steps} {rate:.1f} tok/s\n{old_steps} {old_rate:.1f} tok/s (before)")
    assert steps[21:30] == "." * 9 and steps[40:].count("S") >= 0.95 * len(steps[40:]), steps
    assert old_steps[21:] == "." * len(old_steps[21:]), old_steps
    assert rate > 1.35 * old_rate, (rate, old_rate)


def test_a_draft_that_stays_slow_is_retried_less_and_less(monkeypatch):
    """Negative control: the draft 5x slower from step 20 on, for good. Re-tried at 16, then 32,
    64, ... row-cycles (doubling while it reads slow), within 2.5% of main's rate, which never
    re-tries it in these 160 steps (-2.0% decided every step; -1.0% with the 4-step hold
    released by the request's evidence, removed by prune23)."""
    slow = lambda i: {"d2": 5.0} if i >= 20 else {}  # noqa: E731
    steps, rate = stream(0.8, 0.8, slow=slow, **PER_STEP)
    _, old_rate = stream(0.8, 0.8, slow=slow, probe_slow_after=200, **PER_STEP)
    print(f"\n{steps} {rate:.2f} vs {old_rate:.2f} tok/s")
    tries = [i for i, c in enumerate(steps) if c == "S" and i > 21]
    assert 1 <= len(tries) <= 3 and all(b - a > 40 for a, b in zip(tries, tries[1:])), tries
    assert rate >= 0.975 * old_rate, (rate, old_rate)
    # lazy8 (firm 8-step holds, observations deferred): the slowdown is seen while the hold runs
    # (`StreamHolder.watch`: its models' forwards against the profile, as the step detector
    # reads them), so the draft is left when the per-step router leaves it and re-tried as
    # above. Negative control: unwatched, the deferred steps show it only when folded at the
    # hold's end, the draft ran the rest of its span (-4.8% here)
    lazy_steps, lazy_rate = stream(0.8, 0.8, slow=slow, **LAZY8)
    print(f"{lazy_steps} {lazy_rate:.2f} tok/s (lazy8)")
    assert lazy_steps.index(".", 20) == steps.index(".", 20) and lazy_rate >= 0.99 * rate, (lazy_steps, steps)
    monkeypatch.setattr(StreamHolder, "watch", lambda self, hold, forwards: True)
    blind_steps, blind_rate = stream(0.8, 0.8, slow=slow, **LAZY8)
    print(f"{blind_steps} {blind_rate:.2f} tok/s (lazy8 unwatched)")
    assert blind_steps.index(".", 20) > steps.index(".", 20) + 3 and blind_rate < 0.97 * rate, blind_steps


def test_a_lazy_stream_refuted_early_returns_to_its_draft(monkeypatch):
    """With the firm 8-step hold and deferred observations (lean19's lazy8) the refuted draft is
    left as soon as the per-step router leaves it and the stream returns as early: a firm hold is
    released when its pair's estimate falls past the plan's break-even with plain decoding
    (`StreamHolder.break_even`), not only by `decision_tolerance`. Negative control: without the
    break-even (only the tolerance) the k=1 plan decided at break-even ran two more refuted
    cycles, and the request's estimate after the probe kept plain by hysteresis until patience
    ran out: back at step ~37 (lean19)."""
    for seed in range(3):
        steps, _ = stream(0.05, 0.9, seed=seed, **LAZY8)
        old, _ = stream(0.05, 0.9, seed=seed, **PER_STEP)
        print(f"\n{steps} lazy8\n{old} per-step")
        assert steps.index(".") == old.index(".") <= 10, (steps, old)
        assert steps[30:].count("S") >= 0.95 * len(steps[30:]), steps
    monkeypatch.setattr(StreamHolder, "break_even", lambda self, decision, req: float("-inf"))
    steps, _ = stream(0.05, 0.9, seed=0, **LAZY8)
    assert steps.index(".") > 4 and "S" not in steps[22:35], steps
