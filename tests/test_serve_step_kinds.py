"""The serving bench's "why" (issue 26): a server's steps by kind and its plans by (chain, k),
counted on /metrics (server/metrics.py) and read back by the bench (bench/serve_steps.py)."""

from __future__ import annotations

import pytest

from specrouter.bench.serve_steps import StepKinds, kinds_summary
from specrouter.records.stats import CycleStats
from specrouter.server.metrics import ServerMetrics


def cycle(chain, k, rows, committed):
    n = len(chain)
    return CycleStats(chain=chain, k=k, rows=rows, drafted=[0] * n, accepted=[0] * n, committed=committed,
                      forward_time={}, forward_tokens={}, wall_time=0.0)


def test_steps_by_kind_and_plans_round_trip_through_metrics():
    """Counted steps and row-cycles come back from the rendered page as counted; a later
    reading minus an earlier one is the span between them (kinds absent from it dropped)."""
    m = ServerMetrics()  # the engine thread's path: queued, folded in at render()
    m.engine_step("held", 4, 0.010, 4, 2, 0.010, 4)
    m.engine_step("held", 4, 0.012, 4, 2, 0.012, 4)
    m.engine_step("spec", 2, 0.020, 5, 2, 0.020, 5)
    m.engine_cycle(cycle(("draft", "target"), 4, 2, 5))
    m.engine_cycle(cycle(("target",), 0, 4, 4))
    before = StepKinds.parse(m.render().decode())
    assert before.steps[("held", 4)] == pytest.approx([2, 0.022, 8])
    assert before.steps[("spec", 2)] == pytest.approx([1, 0.020, 5])
    assert before.plans[("draft>target", 4)] == [2, 5] and before.plans[("target", 0)] == [4, 4]
    m.engine_step("plain", 3, 0.009, 3, 2, 0.009, 3)
    m.engine_cycle(cycle(("draft", "target"), 4, 1, 3))
    span = StepKinds.parse(m.render().decode()) - before
    assert span.steps == {("plain", 3): pytest.approx([1, 0.009, 3])}
    assert span.plans == {("draft>target", 4): [1, 3]}
    s = kinds_summary(before + span)
    assert s["kinds"]["held"]["steps"] == 2 and s["kinds"]["held"]["share"] == pytest.approx(0.5)
    assert s["kinds"]["held"]["step_ms"] == pytest.approx(11.0)
    assert s["kinds"]["spec"]["tokens_per_step"] == 5
    assert {(p["chain"], p["k"]): p["tokens_per_cycle"] for p in s["plans"]} == {
        ("draft>target", 4): pytest.approx(8 / 3), ("target", 0): 1.0}


def _sample(page: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_the_engine_threads_observations_are_folded_in_when_metrics_is_scraped(monkeypatch):
    """engine_step / engine_cycle / handoff / observe_governor (the engine thread, every step) only
    queue a record: the counters move at the next render() (a scrape), summed per label set,
    engine_threads the last value in order; a queue that
    nobody scrapes is folded in by the engine thread itself at PENDING_MAX records."""
    from specrouter.server import metrics as mt

    m = ServerMetrics()
    m.engine_step("held", 4, 0.010, 4, 2, 0.009, 4)
    m.engine_step("held", 4, 0.012, 4, 2, 0.011, 3)
    m.engine_cycle(cycle(("draft", "target"), 4, 2, 5))
    m.observe_governor("drop", 1)
    m.engine_step("plain", 0, 0.001, 0, 1, 0.001, 0)  # an empty step: counted by threads only
    m.handoff(0.0005)
    assert m.steps_by_kind.labels("held", "4")._value.get() == 0  # not yet: queued
    page = m.render().decode()
    assert _sample(page, "specrouter_steps_by_kind_total", kind="held", rows="4") == 2
    assert _sample(page, "specrouter_steps_by_kind_seconds_total", kind="held", rows="4") == pytest.approx(0.022)
    assert _sample(page, "specrouter_steps_by_threads_total", threads="2") == 2
    assert _sample(page, "specrouter_steps_by_threads_total", threads="1") == 1
    assert _sample(page, "specrouter_step_seconds_count") == 3
    assert _sample(page, "specrouter_generated_tokens_total") == 7
    assert _sample(page, "specrouter_plan_cycles_total", chain="draft>target", k="4") == 2
    assert _sample(page, "specrouter_governor_changes_total", change="drop") == 1
    assert _sample(page, "specrouter_engine_threads") == 1
    assert _sample(page, "specrouter_handoffs_total") == 1
    monkeypatch.setattr(mt, "PENDING_MAX", 3)
    for _ in range(3):
        m.engine_step("spec", 2, 0.02, 5, 2, 0.02, 5)
    assert m.steps_by_kind.labels("spec", "2")._value.get() == 3 and not m._pending  # folded in by itself


def test_observe_all_counts_as_observe_does():
    """`observe_all` (the flush's histograms: one inc per bucket) renders what observe() per value
    renders, values on a bucket's bound and past the last one included, with labels or without."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from specrouter.server.metrics import observe_all

    values = [0.0005, 0.001, 0.0011, 0.3, 0.3, 7.0, 99.0, 0.0]

    def page(bulk: bool) -> list[str]:
        r = CollectorRegistry()
        h = Histogram("h", "x", buckets=(0.0005, 0.001, 0.25, 5.0), registry=r)
        g = Histogram("g", "x", ["model"], buckets=(1.0, 2.0), registry=r)
        for hist, vs in ((h, values), (g.labels("a"), [0.5, 2.0, 3.0])):
            if bulk:
                observe_all(hist, vs)
            else:
                for v in vs:
                    hist.observe(v)
        return [line for line in generate_latest(r).decode().splitlines() if "_created" not in line]

    assert page(True) == page(False)


def test_an_idle_engine_folds_its_metrics_in(tiny_pool_dirs, monkeypatch):
    """AsyncEngine: an engine idle for IDLE_FOLD_S folds its queued step records in itself
    (nobody scraped /metrics), outside its lock; the control, a longer idle threshold, leaves
    them queued."""
    import asyncio

    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.models.pool import Pool
    from specrouter.server import async_engine as ae

    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")

    def run(idle_fold: float) -> ServerMetrics:
        monkeypatch.setattr(ae, "IDLE_FOLD_S", idle_fold)
        m = ServerMetrics()

        async def main():
            loop_engine = ae.AsyncEngine(Engine(pool, max_num_seqs=2, max_model_len=64), seed=0, metrics=m)
            loop_engine.start()
            try:
                h = loop_engine.submit([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True),
                                       chain=("target",), k=1, per_step=False)
                while not (await h.events.get()).done:
                    pass
                await asyncio.sleep(0.3)
            finally:
                await asyncio.to_thread(loop_engine.stop)

        asyncio.run(main())
        return m

    folded = run(0.05)
    assert not folded.pending() and folded.generated_tokens._value.get() == 5
    kept = run(60.0)
    assert kept.pending() and kept.generated_tokens._value.get() == 0


def test_a_scrape_during_an_idle_fold_waits_for_it():
    """The engine thread's idle fold has taken the queue and is still folding when /metrics is
    scraped: the scrape waits for that fold and renders its records (review18). Negative control:
    with the fold lock made a no-op, the same scrape renders without them."""
    import contextlib
    import threading
    import time

    def scrape_during_fold(lock: bool) -> float | None:
        m = ServerMetrics()
        if not lock:
            m._fold_lock = contextlib.nullcontext()
        m.engine_step("spec", 2, 0.02, 5, 2, 0.02, 5)
        started, fold = threading.Event(), m._fold

        def slow_fold(items):
            started.set()
            time.sleep(0.2)
            fold(items)

        m._fold = slow_fold
        folding = threading.Thread(target=m.flush)  # the engine thread's idle fold
        folding.start()
        assert started.wait(5)
        page = m.render().decode()  # the scrape
        folding.join()
        try:
            return _sample(page, "specrouter_steps_by_kind_total", kind="spec", rows="2")
        except KeyError:
            return None

    assert scrape_during_fold(lock=True) == 1
    assert scrape_during_fold(lock=False) is None
