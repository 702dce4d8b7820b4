"""The router inside the engine: chains and draft lengths switch between cycles, rows of one
batch run different chains, and the output stays exactly the target's (greedy) and follows its
distribution (sampling)."""

import random
import warnings

import pytest
import torch
from fixtures import QuietRouterHooks, load_named_pool, named_router
from test_engine_sampling import PARAMS, PROMPT, V, target_joint  # noqa: F401
from test_engine_sampling import pool as v8_pool  # noqa: F401
from test_greedy_equivalence import MAX_NEW, expected, prompts  # noqa: F401

from specrouter import SpecRouter
from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.router.cost_model import enumerate_chains
from specrouter.records.routing import Decision


class RandomRouter(QuietRouterHooks):
    """A worst-case router: a random chain and draft length for every row, every cycle."""

    def __init__(self, pool, seed=0):
        self.rng = random.Random(seed)
        self.chains = [c for c in enumerate_chains(pool.order, pool.target, max_levels=4)
                       if not any(m in pool.drafters for m in c[1:])]  # a model-free drafter only first
        self.decisions = 0

    def decide(self, row):
        self.decisions += 1
        chain = self.rng.choice(self.chains)
        return Decision(chain=chain, k=0 if len(chain) == 1 else self.rng.randint(1, 8), t_eff=0.0, reason="random")


@pytest.fixture(scope="module")
def sr_random(tiny_pool_dirs):
    sr = named_router(tiny_pool_dirs, ("draft", "mid", "target"), adaptive=False)
    router = RandomRouter(sr.pool)
    return SpecRouter(sr.pool, router), router


def test_greedy_exact_while_chains_switch_every_cycle(sr_random, prompts, expected):
    sr, router = sr_random
    results = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    used = set()
    for r in results:
        used |= set(r.stats.chains)
    assert len(used) >= 4  # rows really switched between chains (and ran different ones at once)
    assert router.decisions >= sum(r.stats.cycles for r in results)


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_sampling_distribution_while_chains_switch(v8_pool):
    exact = target_joint(v8_pool)
    rows = 60_000
    eng = Engine(v8_pool, router=RandomRouter(v8_pool, seed=1))
    g = torch.Generator().manual_seed(99)
    seqs = eng.generate_ids([PROMPT] * rows, [PARAMS] * rows, generator=g)
    out = torch.tensor([s.output_ids for s in seqs])
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((out[:, 0], out[:, 1]), torch.ones(rows, dtype=torch.float64), accumulate=True)
    tv = 0.5 * (counts / rows - exact).abs().sum().item()
    assert tv < 0.03, tv


def test_real_router_is_exact_and_logs_decisions(tiny_pool_dirs, prompts, expected, monkeypatch):
    # the cores count as quiet, so the sweep is saved and its reload is checked on a busy machine
    # too (the busy case, used but not saved, is the next test's)
    import specrouter.router.setup as setup_module

    monkeypatch.setattr(setup_module, "machine_busy", lambda *a, **k: False)
    sr = named_router(tiny_pool_dirs, ("draft", "mid", "target"))
    assert sr.router is not None
    results = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    # every row-cycle was decided: by the router (logged), by the batch's plain hold or by a
    # single stream's speculative hold
    assert len(sr.router.events) + sr.router.planner.held_decisions + sr.router.stream.held >= \
        sum(r.stats.cycles for r in results) - len(results)
    # a second pool load reuses the persisted profile instead of sweeping again
    from specrouter.router.profile import CostProfile, default_profile_path, identity_of

    prof = CostProfile.load(default_profile_path(), [identity_of(r) for r in sr.pool.runners.values()])
    assert not prof.missing([identity_of(r) for r in sr.pool.runners.values()])


def test_a_sweep_on_busy_cores_is_used_but_not_saved(tiny_pool_dirs, tmp_path, monkeypatch):
    import os
    import warnings

    from specrouter.router import profile as profile_module
    from specrouter.router.profile import CostProfile, identity_of
    from specrouter.router.setup import load_or_sweep_profile

    pool = load_named_pool(tiny_pool_dirs, ("draft", "target"))
    idents = [identity_of(r) for r in pool.runners.values()]
    path = tmp_path / "profiles.json"
    cores = os.cpu_count() or 1
    monkeypatch.setattr(profile_module.os, "getloadavg", lambda: (cores + 4.0, 0.0, 0.0))
    with pytest.warns(UserWarning, match="busy"):
        prof = load_or_sweep_profile(pool, path=path, progress=False)
    assert not prof.missing(idents) and not path.exists()
    monkeypatch.setattr(profile_module.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_or_sweep_profile(pool, path=path, progress=False)
    assert not CostProfile.load(path, idents).missing(idents)


def test_a_model_drafters_proposals_are_recorded_for_shadow_scoring(tiny_pool_dirs, prompts):
    """CycleStats.row_proposal: the draft's own proposals (an exact copy of the target proposes
    what the target then commits, greedy and sampled: every level samples with the same
    position-keyed noise), and they teach the (ngram, draft) pair in both modes; none for a
    model-free drafter verified by the target alone."""
    d = tiny_pool_dirs
    sr = SpecRouter.from_pretrained(["ngram", d["same"], d["target"]], names=["ngram", "same", "target"],
                                    target="target", dtype="float64")
    for params in (SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=9, temperature=0.8, seed=3)):
        cycles = []
        for _ in range(2):  # the second time the suffix drafter knows the continuations
            seqs = sr.engine.generate_ids(prompts[:2], [params] * 2, chain=("same", "target"), k=4,
                                          on_cycle=cycles.append)
        first = cycles[0]
        assert [len(p) for p in first.row_proposal] == [4, 4]
        for b, s in enumerate(seqs):
            assert first.row_proposal[b] == s.output_ids[:4]
        mode = "greedy" if params.greedy else "sampling"
        assert sr.router.similarity.stats(("ngram", "same"), mode).trials > 0
        # confirmed tokens (cost_model.py, point 4): what the n-gram and suffix proposed and the
        # copy drafted, the target accepted, every one (a miscounted level would reject some)
        for drafter in ("ngram", "suffix"):
            triple = sr.router.similarity.stats((drafter, "same", "target"), mode)
            assert triple.rejections == 0 and (drafter == "ngram" or triple.accepted > 0)
    # a three-level chain: the suffix drafter judged against the copy's own tokens as it
    # verified the n-gram (what it passed up), sampled
    before = sr.router.similarity.stats(("suffix", "same"), "sampling").trials
    sr.engine.generate_ids(prompts[:2], [SamplingParams(max_new_tokens=9, temperature=0.8, seed=4)] * 2,
                           chain=("ngram", "same", "target"), k=4)
    assert sr.router.similarity.stats(("suffix", "same"), "sampling").trials > before
    assert sr.router.similarity.stats(("ngram", "same", "target"), "sampling").rejections == 0
    cycles.clear()
    sr.engine.generate_ids(prompts[:1], [SamplingParams(max_new_tokens=5)], chain=("ngram", "target"), k=4,
                           on_cycle=cycles.append)
    assert all(c.row_proposal == [] for c in cycles)
