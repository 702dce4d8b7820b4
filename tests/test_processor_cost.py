"""The logits processors' cost in the router (issue 31): the executor measures their seconds and
the row-forwards they processed, the router learns seconds per row-forward and charges a row
with processors that much on every forward it takes part in (cost_model.processor_costs), so it
picks k (or plain decoding) knowing it. Closed forms: a plan's expected latency grows by
exactly processor_forwards(chain, k) times the seconds; the executor's count of row-forwards
equals processor_forwards of the plan each row ran."""

import numpy as np
import pytest
from fixtures import load_named_pool, repeating_prompts
from test_router import make_router

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_mod
from specrouter.engine.engine import Engine
from specrouter.router.cost_model import ModelFreeDraft, best_plan, processor_costs, processor_forwards
from specrouter.router.policy import RowContext, StepReport

CHAINS = [("T",), ("d1", "T"), ("d2", "T"), ("d1", "d2", "T"), ("ngram", "T"), ("ngram", "d2", "T")]


def test_the_plan_pays_the_processor_seconds_once_per_forward():
    width = 20
    t = np.arange(width + 1, dtype=np.float64)
    rows = {"d1": 0.002 + 0.0002 * t, "d2": 0.008 + 0.0008 * t, "T": 0.040 + 0.0025 * t, "ngram": 3e-5 + 0 * t}
    for r in rows.values():
        r[0] = 0.0
    alphas = {("d1", "T"): 0.65, ("d2", "T"): 0.85, ("d1", "d2"): 0.9, ("ngram", "T"): 0.5, ("ngram", "d2"): 0.5}
    c = 0.003
    charged = {**rows, **processor_costs(rows, c, {"ngram"})}
    assert charged["ngram"] is rows["ngram"] and charged["T"][0] == 0.0

    def latency(costs):
        costs = {**costs, "ngram": ModelFreeDraft(cost=costs["ngram"], hit_rate=0.4)}
        return best_plan(CHAINS, 8, costs=costs, alphas=alphas).table.expected_latency

    extra = latency(charged) - latency(rows)  # (C, K)
    for i, chain in enumerate(CHAINS):
        for k in range(1, 9):
            # a verifier's forward runs whatever a model-free drafter proposed: charged once
            assert extra[i, k - 1] == pytest.approx(c * processor_forwards(chain, k, {"ngram"}), rel=1e-9), (chain, k)


def decide(router, sid: int, processors: bool):
    """A fresh request's decision (no hysteresis from an earlier plan)."""
    return router.decide(RowContext(seq_id=sid, context_len=256, processors=processors))


def test_the_router_charges_rows_with_processors_and_picks_shorter_drafts_or_plain():
    router = make_router(order=["d1", "d2", "T"])
    free, charged = decide(router, 0, False), decide(router, 1, True)
    assert (free.chain, free.k) == (charged.chain, charged.k)  # nothing learnt yet: no charge
    router.overhead["processor"] = 0.004  # 10% of a target forward per row-forward
    router.board.changed()
    free, charged = decide(router, 2, False), decide(router, 3, True)
    assert len(free.chain) > 1
    table_free = router.plan_table(RowContext(4, 256))
    table_charged = router.plan_table(RowContext(5, 256, processors=True))
    assert table_charged.t_eff[0, 0] == pytest.approx(table_free.t_eff[0, 0] + 0.004)  # plain: one forward
    assert processor_forwards(charged.chain, charged.k) < processor_forwards(free.chain, free.k)
    router.overhead["processor"] = 0.2  # far dearer than any gain: plain decoding
    router.board.changed()
    assert decide(router, 6, False).chain == free.chain
    assert decide(router, 7, True).chain == ("T",)


def test_the_router_learns_seconds_per_row_forward_apart_from_the_step_overhead():
    router = make_router(order=["d1", "d2", "T"])
    for _ in range(200):
        router.observe_step(StepReport(outcomes=[], forwards=[], wall_time=0.050, forward_time=0.045,
                                       speculative=True, processor_seconds=0.003, processor_rows=6))
    router.deferral.fold()  # deferred observations (lean20's default) are folded where read
    assert router.overhead["processor"] == pytest.approx(0.0005, rel=1e-3)
    assert router.overhead["spec"] == pytest.approx(0.002, rel=1e-3)  # 50 - 45 - 3 ms


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, ("target", "draft", "mid"))


@pytest.mark.parametrize("chain", [("target",), ("draft", "target"), ("draft", "mid", "target"), ("ngram", "target")])
def test_the_executor_counts_the_row_forwards_it_processed(pool, monkeypatch, chain):
    results = []
    step = executor_mod.ChainExecutor.step

    def recording(self, *args, **kwargs):
        results.append(step(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(executor_mod.ChainExecutor, "step", recording)
    prompts = repeating_prompts((7, 12, 9))
    penalties = SamplingParams(max_new_tokens=12, presence_penalty=0.5, frequency_penalty=0.3)  # greedy
    other = SamplingParams(max_new_tokens=12, temperature=0.8, seed=1)  # no processor
    Engine(pool).generate_ids(prompts, [penalties, other, penalties], chain=chain, k=3)
    assert results
    for r in results:
        expected = sum(processor_forwards(o.chain, o.k, set(pool.drafters)) for o in r.outcomes if o.greedy)
        assert r.processor_rows == expected, [(o.chain, o.k) for o in r.outcomes]
        assert (r.processor_seconds > 0.0) == (expected > 0)
