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
    m = ServerMetrics()
    m.observe_step("held", 4, 0.010, 4)
    m.observe_step("held", 4, 0.012, 4)
    m.observe_step("spec", 2, 0.020, 5)
    m.observe_cycle(cycle(("draft", "target"), 4, 2, 5))
    m.observe_cycle(cycle(("target",), 0, 4, 4))
    before = StepKinds.parse(m.render().decode())
    assert before.steps[("held", 4)] == pytest.approx([2, 0.022, 8])
    assert before.steps[("spec", 2)] == pytest.approx([1, 0.020, 5])
    assert before.plans[("draft>target", 4)] == [2, 5] and before.plans[("target", 0)] == [4, 4]
    m.observe_step("plain", 3, 0.009, 3)
    m.observe_cycle(cycle(("draft", "target"), 4, 1, 3))
    span = StepKinds.parse(m.render().decode()) - before
    assert span.steps == {("plain", 3): pytest.approx([1, 0.009, 3])}
    assert span.plans == {("draft>target", 4): [1, 3]}
    s = kinds_summary(before + span)
    assert s["kinds"]["held"]["steps"] == 2 and s["kinds"]["held"]["share"] == pytest.approx(0.5)
    assert s["kinds"]["held"]["step_ms"] == pytest.approx(11.0)
    assert s["kinds"]["spec"]["tokens_per_step"] == 5
    assert {(p["chain"], p["k"]): p["tokens_per_cycle"] for p in s["plans"]} == {
        ("draft>target", 4): pytest.approx(8 / 3), ("target", 0): 1.0}
