"""A draft's later steps are priced apart (CostProfile.later): the first forward of a model in a
step finds its weights evicted by the target's forward before it, the later ones (a draft's
steps 2..k, a tree's deeper levels) find them in cache. On a 2-core Intel Xeon with AMX (bf16)
the shipped 11M draft's one-token step read 0.96 ms as a cycle's first and 0.58 ms later
(medians), while the router priced every step at one speed learned from both: a k's marginal
step cost ~1.1 ms in its model against ~0.7 ms measured, so it chose k=1 where static k=2 ran
4% faster (chat, t=0.7).

1. The executor flags a model's forwards after its first of the step (`ForwardRecord.later`).
2. The profile learns the factor from those alone, and the speed from first forwards alone.
3. The cost model prices steps 2..k at the factor; the router's plans read it as published: with
   a cheap later step a larger k wins."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures import load_named_pool
from test_router import L0, make_router, swept_profile

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.records.routing import RowContext
from specrouter.router.cost_model import chain_rows


def test_the_executor_flags_a_models_later_forwards(tiny_pool_dirs):
    """A pinned draft>target k=3 cycle: the draft's first forward (over its pending tokens) is
    not `later`, its two draft steps are; the target's one forward is not."""
    pool = load_named_pool(tiny_pool_dirs, ("target", "draft"))
    eng = Engine(pool, max_num_seqs=1, max_model_len=96)
    seq = eng.add_request([5, 17, 33, 8, 90], SamplingParams(max_new_tokens=12, ignore_eos=True),
                          chain=("draft", "target"), k=3)
    records = []
    step = eng.executor.step

    def spy(*a, **kw):
        result = step(*a, **kw)
        records.append([(f.model, f.later) for f in result.forwards])
        return result

    eng.executor.step = spy
    while not seq.done:
        eng.step()
    steps = 0
    for rec in records:
        drafts = [later for m, later in rec if m == "draft"]
        assert not drafts or (drafts[0] is False and all(drafts[1:])), rec
        assert [later for m, later in rec if m == "target"] == [False], rec
        steps += max(len(drafts) - 1, 0)
    assert steps >= 6, records  # (a cycle near the end drafts fewer)


def test_the_profile_learns_the_later_factor_apart_from_the_speed():
    """Later forwards at 0.6x the prediction move `later` to ~0.6 and leave the speed; first
    forwards at 1.4x move the prediction and leave `later` (a later forward is then 0.6 of the
    new first one's price)."""
    prof = swept_profile(("d1", "T"), ngram=False)
    base = prof.predict("d1", 1, 1, L0)
    for _ in range(30):
        prof.observe("d1", 1, 1, L0, 0.6 * base, later=True)
    assert prof.speed("d1") == 1.0
    assert math.isclose(prof.later("d1"), 0.6, rel_tol=0.02)
    for _ in range(30):
        prof.observe("d1", 1, 1, L0, 1.4 * base)
    assert math.isclose(prof.predict("d1", 1, 1, L0), 1.4 * base, rel_tol=0.02)  # (speed and shape)
    assert math.isclose(prof.later("d1"), 0.6, rel_tol=0.02)
    assert prof.later("T") == 1.0


def test_the_cost_model_prices_later_steps_at_the_factor():
    """chain_rows: with later 0.5 a k-token draft costs its first step plus (k - 1) half steps;
    k = 1 is unchanged; no factor (or 1) is the old price, bit for bit."""
    table = np.array([0.0, 1e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3, 1.5e-3, 1.6e-3, 1.7e-3, 1.8e-3, 1.9e-3, 2e-3])
    target = np.linspace(0.0, 2e-2, 12) + 1e-2
    target[0] = 0.0
    costs = {"d": table, "T": target}
    args = dict(costs=costs, alphas={("d", "T"): 0.5}, draft_step_overhead=1e-4)
    lat0, tok0 = chain_rows([("d", "T")], 4, **args)
    lat1, _ = chain_rows([("d", "T")], 4, later={"d": 1.0}, **args)
    lat5, tok5 = chain_rows([("d", "T")], 4, later={"d": 0.5}, **args)
    assert np.array_equal(lat0, lat1) and np.array_equal(tok0, tok5)
    ks = np.arange(1, 5)
    assert np.allclose(lat0 - lat5, (ks - 1) * 0.5e-3)


def test_a_cheap_later_step_moves_the_routers_k_up():
    """The router's decision for the same evidence: with the draft's later steps at 0.2 of its
    first the chosen k is larger than at 1 (the old price)."""
    def decided(factor):
        router = make_router(order=["d2", "T"], timer=lambda: 0.0)
        base = router.profile.predict("d2", 1, 1, L0)
        for _ in range(40):
            router.profile.observe("d2", 1, 1, L0, factor * base, later=True)
        router.board.changed()
        return router.decide(RowContext(0, L0))

    old, new = decided(1.0), decided(0.2)
    print(f"\nlater 1.0: {old.chain} k={old.k}; later 0.2: {new.chain} k={new.k}")
    assert new.chain == old.chain == ("d2", "T")
    assert new.k > old.k and new.t_eff < old.t_eff


def test_a_firm_hold_is_not_released_by_its_drafts_later_steps():
    """review30's finding 1: a firm hold watches its models' forwards against the profile
    (`StreamHolder.watch`); a draft's later steps at their learned factor (0.6 of a first step,
    below 1 / jump_ratio) must not read as a speed jump, where a real slowdown still does."""
    from types import SimpleNamespace

    from specrouter.records.routing import ForwardRecord

    router = make_router(order=["d2", "T"], timer=lambda: 0.0)
    prof = router.profile
    base = prof.predict("d2", 1, 1, L0)
    for _ in range(40):
        prof.observe("d2", 1, 1, L0, 0.6 * base, later=True)
    hold = SimpleNamespace(watched=("d2",))  # (all `watch` reads of a StreamHold)
    steps = [ForwardRecord("d2", 1, 1, L0, base), ForwardRecord("d2", 1, 1, L0, 0.6 * base, later=True),
             ForwardRecord("d2", 1, 1, L0, 0.6 * base, later=True), ForwardRecord("d2", 1, 1, L0, 0.6 * base, later=True)]
    router.stream.expected, router.stream.streaks = {}, {}
    assert router.stream.watch(hold, steps) and router.stream.watch(hold, steps)
    slow = [ForwardRecord("d2", 1, 1, L0, 3 * base), ForwardRecord("d2", 1, 1, L0, 1.8 * base, later=True)]
    assert not router.stream.watch(hold, slow)
