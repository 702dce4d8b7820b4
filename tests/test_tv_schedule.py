"""Which steps measure D_TV (router/evidence.py `TvSchedule`, `SimilarityConfig.tv_every` and
`tv_first_cycles`): a request's first cycles and every `tv_every`-th step besides, not every
speculative step (measuring cost a sampled single stream 0.5-0.6 ms of a ~12 ms cycle on a
Sapphire Rapids)."""

from __future__ import annotations

import dataclasses

from fixtures import repeating_prompts

from specrouter import SpecRouter
from specrouter.config import RouterConfig, SamplingParams, SimilarityConfig
from specrouter.records.routing import BatchPlan, Decision, RowContext
from specrouter.router.evidence import TvSchedule
from specrouter.router.request_state import RequestState


def schedule(**kw):
    c = SimilarityConfig(**kw)
    return TvSchedule(c.measure_tv, c.tv_every, c.tv_first_cycles)


def test_a_sampled_stream_is_measured_in_its_first_cycles_then_every_nth_step():
    s = schedule(tv_every=8, tv_first_cycles=4)
    req = RequestState(greedy=False)
    row = RowContext(1, 20, greedy=False)
    measured = []
    for cycle in range(40):
        measured.append(s.wants([row], {1: req} if cycle else {}))
        req.cycles = cycle + 1
    assert measured[:5] == [True] * 5  # no state yet, then its prefill and first 4 cycles
    assert measured[5:] == [(i + 1) % 8 == 0 for i in range(5, 40)]  # steps 8, 16, ...: 5 of 35
    always = schedule(tv_every=1)  # the negative control: every step, as before
    assert all(always.wants([row], {1: req}) for _ in range(10))


def test_greedy_rows_and_a_router_that_does_not_measure_never_ask():
    greedy = RowContext(1, 20, greedy=True)
    s = schedule(tv_every=1)
    assert not any(s.wants([greedy], {}) for _ in range(10))
    assert all(s.wants([RowContext(2, 20, greedy=False)], {}) for _ in range(10))  # a sampled row asks
    off = schedule(measure_tv=False, tv_every=1)
    assert not any(off.wants([RowContext(1, 20, greedy=False)], {}) for _ in range(10))
    pinned_only = schedule(tv_every=4)  # no row to route: pinned rows measured every 4th step
    assert [pinned_only.wants([], {}) for _ in range(8)] == [False, False, False, True] * 2


def run(dirs, every):
    cfg = RouterConfig()
    cfg = dataclasses.replace(cfg, similarity=dataclasses.replace(cfg.similarity, tv_every=every))
    sr = SpecRouter.from_pretrained([dirs["draft"], dirs["target"]], names=["draft", "target"],
                                    target="target", dtype="float64", router_config=cfg)
    router = sr.engine.router  # the real router, its batch planner scripted to draft>target k=4
    router.planner.plan = lambda rows, pinned=(): BatchPlan([Decision(("draft", "target"), 4, 0.0, "fixed")
                                                             for _ in rows])
    reports = []
    observe = router.observe_step
    router.observe_step = lambda r: (reports.append(r), observe(r))[1]
    params = SamplingParams(temperature=0.8, max_new_tokens=48, ignore_eos=True, seed=5)
    sr.engine.generate_ids(repeating_prompts((7,)), [params])
    spec = [r for r in reports if r.outcomes[0].chain == ("draft", "target")]
    return spec, router


def test_the_engine_measures_d_tv_on_the_scheduled_steps_only(tiny_pool_dirs):
    """A sampled stream through a real router and engine: its speculative steps report D_TV
    in its first cycles and then about one in `tv_every`; the estimator still learns from
    them. With `tv_every` 1 (the control) every speculative step reports it."""
    spec, router = run(tiny_pool_dirs, 8)
    measured = [r.outcomes[0].tv is not None for r in spec]
    assert len(spec) >= 16 and any(measured[:3])
    assert sum(measured) <= 4 + len(spec) // 8 + 1 < len(spec)
    assert router.similarity.stats(("draft", "target"), "sampling").tv_positions > 0
    spec, _ = run(tiny_pool_dirs, 1)
    assert len(spec) >= 16 and all(r.outcomes[0].tv is not None for r in spec)
