"""The probing budget charged at what probes really cost (router/probing.py `Prober.settle`,
issue 31's chat fix). Scripted pool and virtual clock of test_router.py."""

from __future__ import annotations

import dataclasses

from test_router import L0, Sim, cost_T, make_router, observe_cycle

from specrouter.config import RouterConfig
from specrouter.router.policy import ForwardRecord, RowContext
from specrouter.router.probing import Prober
from specrouter.router.similarity import ProbeBudget

CAP = 0.005  # probe seconds / wall seconds, at most


class CatchUpSim(Sim):
    """Sim, where a draft model that sat out cycles first reads the tokens committed since it
    last ran (one forward over them, as the engine's catch-up does): a cost the cost model does
    not price, so a probe after a stretch of plain decoding costs far more than predicted."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lag = 0  # tokens committed since the draft last ran

    def run(self, chain, k, sids, L, greedy=True):
        stats, outcomes, fwd, committed = super().run(chain, k, sids, L, greedy)
        if len(chain) > 1 and self.lag:
            s = self.cost(chain[0], 1, self.lag, L)
            fwd = [ForwardRecord(chain[0], 1, self.lag, L, s), *fwd]
            stats = dataclasses.replace(stats, wall_time=stats.wall_time + s)
        self.lag = 0 if len(chain) > 1 else self.lag + committed[0]
        return stats, outcomes, fwd, committed


def probe_stream(steps=1500, **config):
    """One request decided every cycle over a draft that never agrees (alpha 0): its pair's
    evidence fades while it decodes plainly, so the pair is probed again and again, each probe
    predicted as a draft cycle and costing a catch-up besides. Returns (probes, their realised
    extra seconds over plain decoding, wall seconds, the router's budget)."""
    router = make_router(order=["d2", "T"], timer=lambda: 0.0,
                         config=RouterConfig(probe_time_fraction=CAP, **config))
    sim = CatchUpSim({("d2", "T"): 0.0}, seed=3)
    t_plain = cost_T(1, 1, L0) + sim.overhead["plain"]  # plain decoding's true seconds per token
    probes, extra, wall = 0, 0.0, 0.0
    for _ in range(steps):
        d = router.decide(RowContext(0, L0))
        stats, outcomes, fwd, committed = sim.run(d.chain, d.k, [0], L0, True)
        observe_cycle(router, stats, outcomes, fwd)
        wall += stats.wall_time
        if d.reason == "probe":
            probes += 1
            extra += stats.wall_time - t_plain * committed[0]
    return probes, extra, wall, router.prober.budget


def test_probes_are_charged_what_they_cost_and_the_time_cap_binds(monkeypatch):
    """Charged as predicted (the negative control: `Prober.settle` a no-op, as the old rule was,
    `probe_charge_realized=False`, removed by prune23), the probes cost a fraction of what they
    do by the budget's books, and their real extra seconds run past the time cap. Charged their
    realised extra seconds, the books match the clock and the cap binds: the probes' extra
    seconds stay within it plus one probe."""
    probes, extra, wall, budget = probe_stream()
    monkeypatch.setattr(Prober, "settle", lambda self, *a, **kw: self.pending.clear())
    probes_off, extra_off, wall_off, budget_off = probe_stream()
    one = max(budget.history)
    print(f"\nprobes {probes} ({extra / wall:.4f} of wall) vs {probes_off} charged as predicted "
          f"({extra_off / wall_off:.4f}; booked {budget_off.seconds / budget_off.total_seconds:.4f})")
    assert budget_off.seconds < 0.5 * extra_off  # the predicted books miss most of it
    assert extra_off > 1.5 * CAP * wall_off  # ... and the cap does not hold
    assert abs(budget.seconds - extra) < 0.01 * extra  # the realised books are the clock's
    assert extra <= CAP * wall + one
    assert 0 < probes < probes_off


def test_settle_replaces_the_predicted_charge():
    budget = ProbeBudget(fraction=1.0, time_fraction=0.02)
    budget.charge(0.001)
    budget.settle(0.001, 0.004)
    assert budget.seconds == 0.004 and budget.history == [0.004] and budget.probes == 1
    budget.charge(-0.002)  # predicted a gain: charged nothing, realised a loss
    budget.settle(-0.002, 0.003)
    assert budget.seconds == 0.007
