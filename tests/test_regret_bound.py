"""The regret bound (router/regret.py): a single stream's speculation may lose at most
`RouterConfig.regret_fraction` of its elapsed seconds against plain decoding. Scripted pool and
virtual clock of test_router.py."""

from __future__ import annotations

import math

import pytest
from test_router import L0, Sim, make_router, observe_cycle

from specrouter.config import RouterConfig
from specrouter.router.policy import RowContext
from specrouter.router.regret import RegretBank

OUTSIDE = {True: 2e-3, False: 5e-4}  # host seconds outside the executor per step, speculative / plain
CODE, CHAT = 0.8, 0.03  # d1 > T acceptance of the two request types


def run_stream(requests=12, steps=60, **config):
    """Requests alternating code (d1 agrees on 80%) and chat (3%), one at a time, each `steps`
    engine steps through plan_batch on a virtual clock (each step's wall time plus its kind's
    outside seconds). Chat requests start on the prior finished code requests left (the upper
    quantile of their alphas) and learn their own rate one rejection per cycle. Returns, per
    type, (speculative steps, seconds, tokens, steps held plain by the bound)."""
    now = [0.0]
    router = make_router(order=["d1", "T"], step_clock=lambda: now[0], timer=lambda: 0.0,
                         config=RouterConfig(**config))
    sim = Sim({("d1", "T"): CODE}, seed=3)
    out = {"code": [0, 0.0, 0, 0], "chat": [0, 0.0, 0, 0]}
    for sid in range(requests):
        kind = "code" if sid % 2 == 0 else "chat"
        sim.per_request[sid] = {"alphas": {("d1", "T"): CODE if kind == "code" else CHAT}}
        for _ in range(steps):
            d = router.plan_batch([RowContext(sid, L0)]).decisions[0]
            stats, outcomes, fwd, committed = sim.run(d.chain, d.k, [sid], L0, True)
            observe_cycle(router, stats, outcomes, fwd)
            seconds = stats.wall_time + OUTSIDE[d.k > 0]
            now[0] += seconds
            o = out[kind]
            o[0], o[1], o[2] = o[0] + (d.k > 0), o[1] + seconds, o[2] + committed[0]
            o[3] += d.reason == "regret"
        router.finish_request(sid)
    return out


def test_chat_requests_lose_at_most_the_bound_and_code_requests_keep_speculating():
    """With the bound, chat requests (a 3% draft after code requests raised the prior) speculate
    a few cycles each (31-41 of 360 over seeds 3-6) and run ~1.1x faster than without it (the
    negative control), where they speculate until their own evidence outweighs the prior (291-331
    of 360). Code requests are never held by it and speculate every step either way."""
    bounded = run_stream()
    free = run_stream(regret_fraction=None)
    assert bounded["chat"][0] < 0.5 * free["chat"][0], (bounded, free)
    assert bounded["chat"][2] / bounded["chat"][1] > 1.03 * free["chat"][2] / free["chat"][1]
    assert bounded["chat"][3] > 0 and free["chat"][3] == 0
    assert bounded["code"][3] == 0 and bounded["code"][0] == free["code"][0] == 6 * 60


def test_the_bank_counts_speculations_loss_against_plain_seconds():
    bank = RegretBank()
    bank.observe(0.2, 1, False, math.nan)  # the prefill: elapsed only
    assert bank.lost == 0.0 and bank.allows(0.02, 0.0)
    bank.observe(0.025, 1, True, 0.016)  # a speculative cycle of 1 token, 9 ms dearer than plain
    assert bank.lost == pytest.approx(0.009) and bank.elapsed == pytest.approx(0.225)
    assert not bank.allows(0.02, 0.0)  # 9 ms > 2% of 225 ms
    for _ in range(15):
        bank.observe(0.016, 1, False, 0.016)  # plain steps: time passes, no loss
    assert bank.allows(0.02, 0.0)  # 9 ms <= 2% of 465 ms
    bank.observe(0.02, 3, True, 0.016)  # a gain of 28 ms
    assert bank.lost == pytest.approx(-0.019)


def test_the_bound_is_checked():
    with pytest.raises(ValueError):
        RouterConfig(regret_fraction=1.5)
    RouterConfig(regret_fraction=None)
