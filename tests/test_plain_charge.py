"""Plain decoding against speculation with each kind's host seconds outside the executor
(router/host_time.py `PlainCharge`, issue 31's chat goal). Scripted pool and virtual clock of
test_router.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_router import HOLD4, L0, Sim, make_router, observe_cycle, true_plan

from specrouter.config import RouterConfig
from specrouter.router.plan_table import PlanTable
from specrouter.router.host_time import OutsideClock, PlainCharge
from specrouter.router.policy import RowContext

WEAK = {("d1", "T"): 0.15}  # a draft agreeing on 15% of tokens (chat, measured: 10-18%)
OUTSIDE = {True: 4.3e-3, False: 4e-4}  # host seconds outside the executor per step, speculative / plain


def run_stream(steps=200, outside=OUTSIDE, seed=5, decided_pays=False, **config):
    """One request of `steps` engine steps through plan_batch, the virtual clock advanced by
    each step's wall time plus its kind's scripted outside seconds (what plan_batch measures);
    `decided_pays`: a plain step the hold did not plan (decided) pays a speculative step's, as
    measured on the Zen 1 (decide() is most of both). Returns (speculative steps, tokens per
    second, the router)."""
    now = [0.0]
    router = make_router(order=["d1", "T"], step_clock=lambda: now[0], timer=lambda: 0.0,
                         config=RouterConfig(**config))
    sim = Sim(WEAK, seed=seed)
    row, spec, tokens = RowContext(0, L0), 0, 0
    for _ in range(steps):
        held = (router.planner.held_decisions, router.stream.held)
        d = router.plan_batch([row]).decisions[0]
        decided = (router.planner.held_decisions, router.stream.held) == held  # no hold planned it
        # (a plain plan kept by hysteresis is the stream hold's: lazy8's 8-step holds met one)
        stats, outcomes, fwd, committed = sim.run(d.chain, d.k, [0], L0, True)
        observe_cycle(router, stats, outcomes, fwd)
        now[0] += stats.wall_time + outside[d.k > 0 or (decided_pays and decided)]
        spec, tokens = spec + (d.k > 0), tokens + committed[0]
    return spec, tokens / now[0], router


def test_the_world_speculates_by_the_table_and_loses_by_the_clock():
    """The scripted world of the tests below: by forwards and per-cycle overheads d1 > T k=1 is
    ~3% faster than plain decoding, with each kind's outside seconds ~5% slower."""
    plan = true_plan(["d1", "T"], WEAK, overhead=3e-4)
    t_plain = float(plan.table.t_eff[0, 0])
    assert plan.chain == ("d1", "T") and plan.t_eff < 0.98 * t_plain
    charged = plan.t_eff + OUTSIDE[True] / plan.expected_tokens
    assert charged > 1.03 * (t_plain + OUTSIDE[False])


def test_a_single_stream_stays_plain_where_speculations_host_seconds_lose():
    """A speculative step costs 4.3 ms outside the executor (planning, observing, shadow
    proposals: ~10% of the target's step, as on the CPU), a plain one 0.4 ms. Charged where plain
    decoding is weighed against speculation, the router leaves d1 > T within a few steps and
    runs faster; the negative control (no charge: the table alone, `charge_leaving_plain=False`
    before lead23 removed it) keeps speculating and runs slower by the clock."""
    spec, rate, router = run_stream()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PlainCharge, "measured", classmethod(lambda cls, times, charged: cls()))
        spec_off, rate_off, _ = run_stream()
    assert router.overhead["outside_spec"] == pytest.approx(OUTSIDE[True])
    assert spec <= 20 and spec_off >= 180
    assert rate > 1.03 * rate_off


def test_speculation_that_pays_its_host_seconds_still_runs():
    """The same host seconds with a draft that agrees on 45%: speculation beats plain decoding
    by far more than its charge, and the charged router speculates as much as the control."""
    def strong(**config):
        now = [0.0]
        router = make_router(order=["d1", "T"], step_clock=lambda: now[0], timer=lambda: 0.0,
                             config=RouterConfig(**config))
        sim, spec = Sim({("d1", "T"): 0.45}, seed=6), 0
        for _ in range(150):
            d = router.plan_batch([RowContext(0, L0)]).decisions[0]
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0, True)
            observe_cycle(router, stats, outcomes, fwd)
            now[0] += stats.wall_time + OUTSIDE[d.k > 0]
            spec += d.k > 0
        return spec
    assert strong() >= 140
    with pytest.MonkeyPatch.context() as mp:  # uncharged (the table alone)
        mp.setattr(PlainCharge, "measured", classmethod(lambda cls, times, charged: cls()))
        assert strong() >= 140


def table_of(t_eff, tokens):
    t_eff, tokens = np.asarray(t_eff, dtype=float), np.asarray(tokens, dtype=float)
    chains = (("T",),) + tuple((f"d{i}", "T") for i in range(1, len(t_eff)))
    return PlanTable(chains, np.arange(1, t_eff.shape[1] + 1), t_eff, tokens, t_eff * tokens)


def test_no_charge_is_the_tables_own_argmin_and_a_charge_never_reorders_speculative_plans():
    """`PlainCharge.best` without a charge is the PlanTable's argmin (first minimum, ties to
    plain decoding), over random tables with ties and pruned (inf) chains; with a charge the
    speculative plan it weighs is still the table's best speculative one (a per-cycle charge
    would favour long drafts: that reordering lost on the mixed stream)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        t = np.round(rng.uniform(0.8, 1.2, size=(4, 6)), 1)
        t[0] = t[0, 0]  # plain decoding: the same T_eff in every column
        if rng.random() < 0.3:
            t[rng.integers(1, 4)] = np.inf
        tokens = rng.uniform(1.0, 4.0, size=(4, 6))
        table = table_of(t, tokens)
        for cap in (1, 3, 6):
            want = np.unravel_index(int(np.argmin(t[:, :cap])), (4, cap))
            got = PlainCharge().best(table, cap)
            assert (got[0], got[1] if got[0] else 0) == (int(want[0]), int(want[1]) if want[0] else 0)
            charge = PlainCharge(spec=0.5, plain=-0.1)
            i, j = charge.best(table, cap)
            sub = t[1:, :cap]
            si, sj = np.unravel_index(int(np.argmin(sub)), sub.shape)
            if i:
                assert (i, j) == (int(si) + 1, int(sj))
            else:  # plain: it beats the best speculative plan once both are charged (or none is finite)
                assert not np.isfinite(sub[si, sj]) or t[0, 0] - 0.1 <= sub[si, sj] + 0.5 / tokens[si + 1, sj]


def test_the_charge_reads_the_measured_outside_seconds():
    """Nothing measured (a simulated pool without a step clock): no charge; measured: each
    kind's outside seconds less what the table already charges (decide()'s)."""
    none = PlainCharge.measured({"outside_spec": 0.0, "outside_plain": 0.0}, 2e-4)
    assert none == PlainCharge()
    c = PlainCharge.measured({"outside_spec": 1.1e-3, "outside_plain": 3e-4}, 2e-4)
    assert c.spec == pytest.approx(9e-4) and c.plain == pytest.approx(1e-4)
    table = table_of([[1.0, 1.0], [0.99, 0.98]], [[1.0, 1.0], [1.1, 1.2]])
    assert PlainCharge().best(table, 2) == (1, 1)
    assert PlainCharge(spec=0.05).best(table, 2) == (0, 0)  # 0.98 + 0.05 / 1.2 > 1.0


def test_the_charged_table_is_each_cells_kind_charge():
    """`PlainCharge.t_eff`, the one (C, K) form that `best`, the hysteresis and the prober read:
    row 0 (plain decoding) carries `plain`, a speculative cell `spec` / its expected tokens, a
    pruned chain stays +inf. Before, the prober spelled it itself and charged row 0 `spec` too."""
    table = table_of([[1.0, 1.0], [0.99, 0.98], [np.inf, np.inf]], [[1.0, 1.0], [1.1, 1.2], [np.nan, np.nan]])
    charge = PlainCharge(spec=0.05, plain=0.01)
    got = charge.t_eff(table)  # (3, 2)
    assert got[0].tolist() == [1.0 + 0.01, 1.0 + 0.01]
    assert got[1].tolist() == [0.99 + 0.05 / 1.1, 0.98 + 0.05 / 1.2]
    assert np.isinf(got[2]).all()
    assert charge.nonzero and PlainCharge(plain=1e-4).nonzero and not PlainCharge().nonzero
    rng = np.random.default_rng(1)
    for _ in range(100):  # `best` with the kept (C, K) form decides as it does computing it
        t = np.round(rng.uniform(0.8, 1.2, size=(4, 6)), 2)
        t[0] = t[0, 0]
        table = table_of(t, rng.uniform(1.0, 4.0, size=(4, 6)))
        charge = PlainCharge(spec=float(rng.uniform(0, 0.5)), plain=float(rng.uniform(-0.05, 0.05)))
        for cap in (1, 4, 6):
            assert charge.best(table, cap, charge.t_eff(table)) == charge.best(table, cap)


def test_a_probe_from_a_plain_plan_carries_both_kinds_charge():
    """A single stream decoding plainly is probed only where the probe beats plain decoding with
    both kinds' host seconds: an untried draft (optimistic alpha 1) is probed with no charge and
    with a small one, not when a speculative cycle's outside seconds exceed what it could save
    (the negative control: the same call uncharged probes)."""
    from specrouter.router.similarity import GREEDY

    router = make_router(order=["d1", "T"], timer=lambda: 0.0)
    row = RowContext(0, L0)
    costs, alphas, overhead = router.inputs(row, router.request(0, True))
    t_plain = float(router.table(costs, alphas, overhead, 8).t_eff[0, 0])

    def probe(*args):
        router.prober.probes.clear()  # each call as the first look (no back-off from the last)
        return router.prober._probe(*args)

    assert probe(GREEDY, ("T",), t_plain, costs, alphas, overhead, 8) is not None
    assert probe(GREEDY, ("T",), t_plain, costs, alphas, overhead, 8, PlainCharge(spec=1e-3)) is not None
    assert probe(GREEDY, ("T",), t_plain, costs, alphas, overhead, 8, PlainCharge(spec=1.0)) is None


def test_a_failed_draft_under_a_charge_is_left_for_plain_decoding():
    """A single stream speculating with both kinds' host seconds measured; its draft fails
    (`mark_failed`): plain decoding, the only chain left, is decided at once. Before the charged
    table, the failed plan's charged T_eff read NaN (inf + spec / NaN tokens), no rule fired and
    hysteresis kept the failed chain."""
    now = [0.0]
    router = make_router(order=["d1", "T"], step_clock=lambda: now[0], timer=lambda: 0.0)
    sim = Sim({("d1", "T"): 0.45}, seed=6)
    for _ in range(40):
        d = router.plan_batch([RowContext(0, L0)]).decisions[0]
        stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0, True)
        observe_cycle(router, stats, outcomes, fwd)
        now[0] += stats.wall_time + OUTSIDE[d.k > 0]
    assert d.chain == ("d1", "T") and router.overhead["outside_spec"] > 0.0
    router.mark_failed("d1")
    d = router.decide(RowContext(0, L0))
    assert d.chain == ("T",), d


def test_plain_decoding_is_priced_at_its_held_steps():
    """A stream leaving speculation decides its first plain steps, which cost what a speculative
    step does outside the executor; only once settled is it held, at a tenth of that. Priced at
    its held steps (and, before one is measured, at none of decide()'s seconds), plain decoding
    wins at once and the stream is held; the negative control (every plain step read as held,
    as `outside_plain_held=False` did before session 23 removed it) prices it at its decided
    steps, so speculation looks no dearer than plain decoding: it keeps going back to d1 > T
    and runs slower by the clock."""
    # the 4-step hold (HOLD4): the default's 8-step plain holds leave few decided plain steps, so the
    # control prices plain decoding near its held steps too (48 speculative steps, 0.998x)
    spec, rate, router = run_stream(decided_pays=True, **HOLD4)
    real = OutsideClock.planning

    def every_plain_step(self, *a, **kw):  # the old rule: a decided plain step counts as a held one
        m = real(self, *a, **kw)
        return m if m is None or m[1] else (m[0], m[1], True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OutsideClock, "planning", every_plain_step)
        spec_off, rate_off, router_off = run_stream(decided_pays=True, **HOLD4)
    print(f"\nspeculative steps {spec} vs {spec_off}; {rate:.2f} vs {rate_off:.2f} tok/s")
    assert router.overhead["outside_plain"] == pytest.approx(OUTSIDE[False])
    assert router_off.overhead["outside_plain"] > 2 * OUTSIDE[False]
    assert spec <= 20 and spec_off >= 150
    assert rate > 1.015 * rate_off  # measured 1.020x (the firm 4-step hold; 1.028x with the unfirm one, removed by prune23)


def test_leaving_plain_is_priced_at_a_speculative_streams_held_steps():
    """Held speculative steps priced apart (floor21; `outside_spec_held` until lead23): plan_batch measures a speculative single
    stream's held steps (its firm hold's) apart, and where a decision weighs plain decoding
    against speculation a speculative cycle pays those, as plain decoding pays its held steps':
    a stream that rarely speculates runs mostly decided speculative steps (probes), whose
    decide() priced leaving plain too high. With held speculative steps as cheap as plain ones
    and decided ones 4.3 ms, the router speculates on a draft the table finds ~3% faster; the
    negative control (every speculative step's mean: no held reading published) stays plain."""
    now = [0.0]
    router = make_router(order=["d1", "T"], step_clock=lambda: now[0], timer=lambda: 0.0,
                         config=RouterConfig(overhead_alpha=0.2))
    sim = Sim({("d1", "T"): 0.6}, seed=5)
    row = RowContext(0, L0)
    for _ in range(120):  # a speculating stream: each firm hold decided once, then held
        held = router.stream.held
        d = router.plan_batch([row]).decisions[0]
        stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0, True)
        observe_cycle(router, stats, outcomes, fwd)
        now[0] += stats.wall_time + (OUTSIDE[False] if d.k == 0 or router.stream.held > held else OUTSIDE[True])
    assert router.stream.held > 30
    assert router.overhead["outside_spec_held"] == pytest.approx(OUTSIDE[False])
    assert router.overhead["outside_spec"] > 1.5 * OUTSIDE[False]  # decided steps among them

    def decides(held_spec: bool):
        r = make_router(order=["d1", "T"], timer=lambda: 0.0)
        for _ in range(400):
            r.similarity.observe_acceptance(("d1", "T"), "greedy", 15, 85)
        r.overhead.update(outside_plain=OUTSIDE[False], outside_spec=OUTSIDE[True],
                          outside_spec_held=OUTSIDE[False] if held_spec else 0.0)
        r.board.changed()
        return r.decide(RowContext(7, L0))

    assert decides(True).k > 0
    assert decides(False).k == 0
