"""A settled plain single stream on an engine lease (floor21; was `RouterConfig.plain_lease`, on,
its False branch removed by prune23, issue 27): its held steps run without planning, are reported
in order before the router plans again, and still return to speculation when it pays. The
negative controls patch in the old path (`plain_lease=False`): a lease of one step (every held
step planned) and a single stream's shadow proposals every 4th held step
(`BatchPlanner.SHADOW_EVERY_HELD`, removed with it)."""

from __future__ import annotations

from collections import Counter

import pytest

from specrouter.config import SamplingParams
from specrouter.engine import engine as engine_module
from specrouter.engine.engine import Engine
from specrouter.records.routing import RowContext
from specrouter.router.batch import PlainHold
from specrouter.router.host_time import OutsideClock
from fixtures import load_named_pool
from test_engine_batching import alone, prompts_of, scripted_router


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, ["draft", "mid", "target"])


def plain_wins(b, t, L):
    return 0.040 * t  # verifying t tokens costs t forwards: plain decoding wins


def old_shadow_due(self, now: int) -> bool:
    """The unleased single stream's rule (prune23 removed it): shadows every 4th held step."""
    return now == self.until - 1 if self.rows > 1 else now % 4 == 0


def run(pool, lease: bool, n: int = 60, switch_at: int | None = None):
    """One greedy request of `n` tokens alone on the scripted router (its profile and host
    overheads fixed: the tiny models' real timings, a process's cold first steps among them,
    are not learned). `switch_at`: from that engine step on, verifying
    is flat (speculation pays) and the evidence is republished. `lease=False`: the old path
    patched in. Returns what the test reads."""
    with pytest.MonkeyPatch.context() as mp:
        if not lease:
            mp.setattr(PlainHold, "shadow_due", old_shadow_due)
        return _run(pool, lease, n, switch_at, mp)


def _run(pool, lease, n, switch_at, mp):
    router = scripted_router(plain_wins)
    if not lease:  # a lease of one step: every held step planned
        lease_of = router.planner._lease
        router.planner._lease = lambda now, steps: lease_of(now, 1)
    router.profile.observe_many = lambda *a, **k: None
    router._observe_overhead = lambda report: None
    eng = Engine(pool.with_fresh_drafters(), router=router, max_num_seqs=1, max_model_len=128)
    counts, seen, kinds, shadowed = Counter(), [], [], []
    due = set()  # engine steps due a shadow: decided ones, and each plain hold's last
    plan, observe = router.plan_batch, router.observe_step

    def planned(rows, pinned=()):
        assert not eng._unreported  # the router has seen every step before it plans
        counts["plan"] += 1
        batch = plan(rows, pinned)
        hold = router.planner.hold
        due.add(eng.steps + (hold.until - 1 - router.observed_steps if batch.held else 0))
        return batch

    def observed(report):
        seen.append(report.outcomes[0].context_len)
        observe(report)

    router.plan_batch, router.observe_step = planned, observed
    proposals = engine_module.shadow_proposals  # the steps whose shadow proposals ran
    mp.setattr(engine_module, "shadow_proposals", lambda rows, *a: shadowed.append(eng.steps) or proposals(rows, *a))
    seq = eng.add_request(prompts_of(1)[0], SamplingParams(max_new_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        if switch_at is not None and eng.steps == switch_at:
            router.profile.set_function("target", lambda b, t, L: 0.040, batch_sizes=(1, 4, 8),
                                        new_tokens=(1, 2, 4, 8, 16), context_lengths=(128, 1024))
            router.board.changed()
        eng.step()
        kinds.append(eng.last_step_kind)
    return router, counts, seen, kinds, shadowed, seq.output_ids, {s for s in due if s <= eng.steps}


def test_a_leased_plain_stream_is_planned_once_a_span_and_reports_every_step(pool):
    """With the lease, the held steps of a settled plain stream are not planned (no row
    context, no plan_batch): the router plans about once per span, sees every step once, in
    order, before it plans again, holds as many decisions, reaches the same hold, and the
    shadow proposals run on the spans' last steps only; greedy output is the target's.
    Negative control, the old path: without the lease (one step) every step is planned and
    the shadows run every 4th held step."""
    unleased = run(pool, False)
    leased = run(pool, True)
    for router, counts, seen, kinds, _, output, _ in (leased, unleased):
        assert output == alone(pool, prompts_of(1)[0], 60)
        assert len(seen) == len(kinds) == router.observed_steps  # every step reported
        assert seen == sorted(seen) and len(set(seen)) == len(seen)  # in order, once each
        assert kinds.count("held") >= len(kinds) - 8
    assert leased[3] == unleased[3]  # the same steps held
    assert leased[0].planner.held_decisions == unleased[0].planner.held_decisions > 0
    assert leased[0].planner.hold.span == unleased[0].planner.hold.span == 16
    assert unleased[1]["plan"] == len(unleased[3])
    assert leased[1]["plan"] <= len(leased[3]) // 4, leased[1]
    held = unleased[3].count("held")
    print(f"\nshadowed steps {len(leased[4])} leased ({leased[1]['plan']} plans) vs {len(unleased[4])} unleased "
          f"({held} held steps)")
    assert 0 < len(leased[4]) <= leased[1]["plan"] // 2
    assert set(leased[4]) == leased[6], (leased[4], leased[6])  # on a held span's last step, not every 4th
    assert len(unleased[4]) >= held // 4 - 1 and set(unleased[4]) != unleased[6]  # the old rule: every 4th


def test_a_leased_plain_stream_returns_to_speculation_when_it_pays(pool, monkeypatch):
    """The lease ends with the hold (the step before its last, which is planned), so the
    decision at each hold's end reads the evidence as without it: once verifying is flat a
    leased plain stream speculates again at the same step as the unleased one. Negative
    control: a hold that does not end stays plain."""
    out = {lease: run(pool, lease, n=90, switch_at=20) for lease in (True, False)}
    back = {lease: out[lease][3].index("spec", 20) for lease in out}
    assert back[True] == back[False] <= 20 + 16, back
    for lease in out:
        assert out[lease][5] == alone(pool, prompts_of(1)[0], 90)
    monkeypatch.setattr(PlainHold, "valid", lambda self, n, now: True)
    stuck = run(pool, True, n=90, switch_at=20)
    assert "spec" not in stuck[3][20:]


def test_the_outside_clock_prices_a_lease_at_its_mean_step():
    """A plan whose lease ran m more steps is measured at the next planning over all m + 1:
    the period's seconds outside the executor per step (at most their mean wall); a step of
    the lease not observed leaves it unmeasured."""
    rows = [RowContext(0, 200)]
    clock = OutsideClock()
    clock.planning(0.0, 0, rows)
    clock.held()
    for i in range(4):  # the planned step and three leased ones, 8 ms each
        clock.observed(i, 0.008, False)
    assert clock.planning(0.034, 4, rows) == pytest.approx((0.0005, False, True))
    clock.observed(4, 0.008, False)
    clock.observed(6, 0.008, False)  # step 5 was never observed
    assert clock.planning(0.060, 7, rows) is None
