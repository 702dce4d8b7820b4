"""The router's components with scripted fake models: known costs T_M(b, t, L) and known iid
pairwise acceptances, simulated on a virtual clock (no torch models).

The simulator plays a cycle the way the executor does: the drafter proposes k tokens (k one-token
forwards of a draft model, or one model-free lookup that hits with the row's hit rate), every
later level runs one forward over the candidates that reached it (padded to the widest row) and
accepts each with its pair's probability up to the first rejection, passing up accepted + 1."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from specrouter.config import RouterConfig
from specrouter.records.stats import CycleStats
from specrouter.models.runners.base import ModelRunner
from specrouter.router.cost_model import ModelFreeDraft, best_plan, enumerate_chains
from specrouter.router.host_time import OutsideClock
from specrouter.router.policy import (
    Decision,
    ForwardRecord,
    Router,
    RowContext,
    RowOutcome,
    StepReport,
)
from specrouter.router.probing import Prober
from specrouter.router.profile import (
    CostProfile,
    ModelIdentity,
    ProfileConfig,
    default_profile_path,
    sweep,
)
from specrouter.router.similarity import (
    GREEDY,
    SAMPLING,
    ProbeBudget,
    SimilarityEstimator,
    acceptance_trials,
    blend,
    candidate_mask,
    candidate_tv,
    shadow_match,
    tv_distance,
    tv_from_logits,
)

# ---------------------------------------------------------------------------------------------
# the scripted world


def cost_T(b, t, L):
    return 0.040 + 0.0025 * b * t + 2e-6 * L * b


def cost_d2(b, t, L):
    return 0.008 + 0.0008 * b * t + 4e-7 * L * b


def cost_d1(b, t, L):
    return 0.002 + 0.0002 * b * t + 1e-7 * L * b


def cost_ngram(b, t, L):
    return 3e-5 * b + 1e-6 * t * b


COSTS = {"ngram": cost_ngram, "d1": cost_d1, "d2": cost_d2, "T": cost_T}
SIZES = {"d1": 10_000_000, "d2": 60_000_000, "T": 400_000_000}
ORDER4 = ["ngram", "d1", "d2", "T"]
ALPHAS = {("d1", "T"): 0.65, ("d2", "T"): 0.85, ("d1", "d2"): 0.9,
          ("ngram", "T"): 0.5, ("ngram", "d1"): 0.5, ("ngram", "d2"): 0.5}
HIT = 0.3  # n-gram hit rate
L0 = 256  # context length of the simulated rows
# 4-step stream holds (the default 8 since lean20): tests of what a shorter hold does pin it
# (the evidence-released, undeferred hold before lean20 was removed by prune23, issue 27)
HOLD4 = dict(stream_hold_steps=4)


class VClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeRunner(ModelRunner):
    """A ModelRunner whose forward costs cost(b, t, L) seconds of a virtual clock."""

    def __init__(self, name, cost, clock, num_params=1):
        self.name, self.cost, self.clock = name, cost, clock
        self.vocab_size, self.max_context, self.num_params = 32, 4096, num_params
        self.num_slots, self.max_len = 0, 0
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def reserve(self, num_slots, max_len):
        self.num_slots, self.max_len = max(num_slots, self.num_slots), max(max_len, self.max_len)

    def forward(self, batch):
        b, t = len(batch.slots_list), max(batch.num_tokens_list)
        self.clock.t += self.cost(b, t, sum(batch.starts_list) / b)
        return torch.zeros(b, batch.logit_positions.shape[1], self.vocab_size)


class FakeDrafter:
    name, is_model_free = "ngram", True

    def __init__(self, clock):
        self.clock = clock

    def propose(self, contexts, k):
        self.clock.t += cost_ngram(len(contexts), k, len(contexts[0]))
        return torch.zeros(len(contexts), k, dtype=torch.long), torch.zeros(len(contexts), dtype=torch.long)


def swept_profile(models=("d1", "d2", "T"), ngram=True, config=None):
    clock = VClock()
    runners = {m: FakeRunner(m, COSTS[m], clock, SIZES[m]) for m in models}
    drafters = {"ngram": FakeDrafter(clock)} if ngram else {}
    return sweep(runners, drafters, repeats=1, warmup=0, progress=False, clock=clock,
                 profile=CostProfile(config))


class Sim:
    """Plays cycles of the iid model; per-request acceptance overrides for request types."""

    def __init__(self, alphas, hit=HIT, seed=0, overhead_spec=3e-4, overhead_plain=1e-4, draft_step_host=0.0):
        self.costs = dict(COSTS)
        self.slow = defaultdict(lambda: 1.0)  # scripted slowdowns
        self.alphas, self.hit = dict(alphas), hit
        self.per_request: dict[int, dict] = {}  # seq_id -> {"alphas": {...}, "hit": h}
        self.rng = random.Random(seed)
        self.overhead = {"spec": overhead_spec, "plain": overhead_plain}
        self.draft_step_host = draft_step_host  # host seconds per model draft step after the first
        self.draft = (0, 0.0)  # the last cycle's (draft steps, their host seconds)
        # (ngram, d, T) -> beta: T accepts the tokens the n-gram and d agree on with beta (and d's
        # own with its alpha), in ngram > d > T and, where the n-gram would have agreed, in d > T
        self.confirmed: dict[tuple[str, str, str], float] = {}
        self.hidden: dict[int, tuple] = {}  # seq_id -> (n-gram proposal, d's draft, T's (candidates, accepted)) of a d > T row

    def accept_confirmed(self, beta, alpha, n, confirmed):
        """Accepted of n candidates: the first `confirmed` with beta, the others with alpha."""
        a = 0
        while a < n and self.rng.random() < (beta if a < confirmed else alpha):
            a += 1
        return a

    def cost(self, m, b, t, L):
        return self.costs[m](b, t, L) * self.slow[m]

    def alpha(self, sid, pair):
        return self.per_request.get(sid, {}).get("alphas", {}).get(pair, self.alphas[pair])

    def hit_rate(self, sid):
        return self.per_request.get(sid, {}).get("hit", self.hit)

    def accept(self, alpha, n):
        a = 0
        while a < n and self.rng.random() < alpha:
            a += 1
        return a

    def run(self, chain, k, sids, L, greedy=True):
        """One group cycle: (CycleStats, RowOutcomes, ForwardRecords)."""
        b, N = len(sids), len(chain)
        fwd, ftime = [], defaultdict(float)

        def forward(m, t, count=1):
            s = self.cost(m, b, t, L) * count
            fwd.append(ForwardRecord(m, b, t, L, s, count))
            ftime[m] += s

        drafted = [[0] * N for _ in sids]
        accepted = [[0] * N for _ in sids]
        if N == 1:
            forward(chain[0], 1)
            committed = [1] * b
        else:
            d = chain[0]
            if d == "ngram":
                forward(d, k)
                n = [k if self.rng.random() < self.hit_rate(s) else 0 for s in sids]
            else:
                forward(d, 1, count=k)
                n = [k] * b
            for r in range(b):
                drafted[r][0] = n[r]
            for j in range(1, N):
                forward(chain[j], max(n) + 1)
                for r, s in enumerate(sids):
                    alpha = self.alpha(s, (chain[j - 1], chain[j]))
                    beta = self.confirmed.get(chain[:3]) if j == 2 else None
                    hidden = ("ngram", *chain) if N == 2 and j == 1 and ("ngram", *chain) in self.confirmed else None
                    if beta is not None:  # the first accepted[1] are confirmed
                        a = self.accept_confirmed(beta, alpha, n[r], accepted[r][1])
                    elif hidden is not None:  # where the n-gram would have agreed with d
                        agree = self.accept(self.alpha(s, ("ngram", chain[0])), k) if self.rng.random() < self.hit_rate(s) else -1
                        a = self.accept_confirmed(self.confirmed[hidden], alpha, n[r], max(agree, 0))
                        proposal = [] if agree < 0 else list(range(agree)) + [-1] * (k - agree)
                        self.hidden[s] = (proposal, list(range(k)), (n[r], a))
                    else:
                        a = self.accept(alpha, n[r])
                    drafted[r][j], accepted[r][j] = n[r], a
                    n[r] = a + 1
            committed = n
        steps = k - 1 if N > 1 and chain[0] != "ngram" else 0
        self.draft = (steps, steps * self.draft_step_host)
        wall = sum(ftime.values()) + self.overhead["spec" if N > 1 else "plain"] + self.draft[1]
        stats = CycleStats(chain=tuple(chain), k=k if N > 1 else 0, rows=b,
                           drafted=[sum(x[j] for x in drafted) for j in range(N)],
                           accepted=[sum(x[j] for x in accepted) for j in range(N)],
                           committed=sum(committed), forward_time=dict(ftime),
                           forward_tokens={}, wall_time=wall)
        outcomes = [RowOutcome(s, tuple(chain), k if N > 1 else 0, drafted[r], accepted[r], greedy, L)
                    for r, s in enumerate(sids)]
        return stats, outcomes, fwd, committed

    def shadow(self, sid, k, committed):
        """What the n-gram would have proposed vs what was committed (an exact shadow score)."""
        if self.rng.random() >= self.hit_rate(sid):
            return [], [0] * committed
        m = self.accept(self.alpha(sid, ("ngram", "T")), committed)
        return [1] * k, [1] * m + [2] * (committed - m)


def observe_cycle(router, stats, outcomes, forwards, draft=(0, 0.0)):
    """One simulated cycle (one chain's rows) told to the router as the engine tells a step;
    `draft`: its (draft steps, their host seconds)."""
    router.observe_step(StepReport(outcomes, forwards, stats.wall_time, sum(stats.forward_time.values()),
                                   len(stats.chain) > 1, draft_steps=draft[0], draft_host_seconds=draft[1]))


def drive(router, sim, cycles, sids=(0,), L=L0, greedy=True, shadow=False, trace=None, timed=True):
    """Run `cycles` engine steps; returns (tokens committed, virtual seconds incl. decide())."""
    clock, tokens = 0.0, 0
    for _ in range(cycles):
        t0 = time.perf_counter()
        decisions = {s: router.decide(RowContext(s, L, batch_size=len(sids), greedy=greedy)) for s in sids}
        clock += time.perf_counter() - t0 if timed else 0.0
        groups = defaultdict(list)
        for s, d in decisions.items():
            groups[(d.chain, d.k)].append(s)
        for (chain, k), members in groups.items():
            stats, outcomes, fwd, committed = sim.run(chain, k, members, L, greedy)
            observe_cycle(router, stats, outcomes, fwd, sim.draft)
            clock += stats.wall_time
            tokens += sum(committed)
            if shadow:
                for s, c in zip(members, committed):
                    if chain[0] != "ngram":
                        prop, com = sim.shadow(s, 16, c)
                        router.observe_shadow(s, "ngram", prop, com, 16, greedy)
                    if s in sim.hidden:  # the n-gram against d's own draft, T's judgement of it
                        prop, drafted, target = sim.hidden.pop(s)
                        router.observe_shadow(s, "ngram", prop, drafted, len(drafted), greedy, verifier=chain[0],
                                              count_hit=False, target=target)
        if trace is not None:
            trace.append(decisions)
    return tokens, clock


def true_plan(order, alphas, hit=HIT, b=1, L=L0, slow=None, k_max=16, overhead=0.0, draft_step=0.0):
    slow = slow or {}
    costs = {m: [0.0] + [COSTS[m](b, t, L) * slow.get(m, 1.0) for t in range(1, 24)]
             for m in order if m != "ngram"}
    if "ngram" in order:
        costs["ngram"] = ModelFreeDraft(cost=lambda k: cost_ngram(b, k, L) * slow.get("ngram", 1.0), hit_rate=hit)
    chains = [c for c in enumerate_chains(order, "T") if "ngram" not in c[1:]]
    return best_plan(chains, k_max, costs=costs, alphas=alphas, overhead=overhead, draft_step_overhead=draft_step)


def true_t_eff(plan_table, chain, k):
    i = plan_table.chains.index(tuple(chain))
    return float(plan_table.t_eff[i, max(k, 1) - 1])


class StepTimer:
    """A deterministic stand-in for perf_counter: every decide() takes `step` seconds."""

    def __init__(self, step=2e-4):
        self.t, self.step, self.calls = 0.0, step, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            self.t += self.step
        return self.t


def make_router(order=ORDER4, profile=None, config=None, timer=None, **kw):
    """A router over the scripted pool; by default decide() 'takes' 200 us (deterministic)."""
    profile = profile or swept_profile(tuple(m for m in order if m != "ngram"), "ngram" in order)
    return Router(order, "T", profile, model_free={"ngram"} & set(order), sizes=SIZES, config=config,
                  timer=timer or StepTimer(), **kw)


# ---------------------------------------------------------------------------------------------
# profile


def test_sweep_tabulates_the_cost_and_interpolates_exactly():
    prof = swept_profile()
    # the fake costs are linear in b, t and L: interpolation and extrapolation above are exact
    for m in ("d1", "d2", "T"):
        for b, t, L in [(1, 1, 128), (4, 16, 1024), (2, 3, 500), (8, 20, 2000), (1, 5, 64)]:
            want = COSTS[m](b, t, max(L, 128))  # below the grid: the first point
            assert prof.predict(m, b, t, L) == pytest.approx(want, rel=1e-9)
        row = prof.cost_row(m, 3, 700, 20)
        assert row[0] == 0 and row[1:] == pytest.approx([COSTS[m](3, t, 700) for t in range(1, 21)])
    assert prof.predict("ngram", 2, 8, 300) == pytest.approx(cost_ngram(2, 8, 300))
    assert prof.identity("T") == ModelIdentity("T", SIZES["T"], "float32")
    assert prof.identity("ngram").dtype == "model-free"


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_sweep_drives_real_runners(tiny_pool_dirs, backend):
    """The sweep honours the runner contract (prefill, then forwards starting at L) and frees
    the slots it borrowed; the NgramDrafter is timed through propose()."""
    from specrouter.drafters.ngram import NgramDrafter
    from specrouter.models.pool import load_runner

    runner = load_runner(tiny_pool_dirs["target"], name="t", backend=backend, dtype=torch.float64)
    prof = sweep({"t": runner}, {"ngram": NgramDrafter()}, batch_sizes=(1, 2), new_tokens=(1, 3),
                 context_lengths=(4, 300), repeats=1, progress=False)
    assert prof.predict("t", 2, 3, 300) > 0 and prof.predict("ngram", 1, 3, 4) > 0
    assert prof.identity("t") == ModelIdentity("t", runner.num_params, "float64")
    assert [runner.allocate_slot() for _ in range(2)]  # the slots came back


def test_profile_ema_shows_a_3x_slowdown_within_two_observations():
    prof = CostProfile()
    prof.set_function("m", cost_T)
    base = cost_T(1, 1, 256)
    for _ in range(3):
        prof.observe("m", 1, 1, 256, base)
    assert prof.predict("m", 1, 1, 256) == pytest.approx(base, rel=1e-6)
    prof.observe("m", 1, 1, 256, 3 * base)
    assert prof.predict("m", 1, 1, 256) < 1.14 * base  # one outlier: a clipped step (1.5^0.3)
    prof.observe("m", 1, 1, 256, 3 * base)
    assert prof.predict("m", 1, 1, 256) == pytest.approx(3 * base, rel=0.05)  # the step detector
    # the slowdown reaches shapes never observed (plain decoding while the model only verified)
    assert prof.predict("m", 4, 9, 1000) == pytest.approx(3 * cost_T(4, 9, 1000), rel=0.05)
    for _ in range(2):  # and recovers as fast
        prof.observe("m", 1, 1, 256, base)
    assert prof.predict("m", 1, 1, 256) == pytest.approx(base, rel=0.05)


def test_profile_fast_ema_without_the_step_detector():
    prof = CostProfile(ProfileConfig(jump_ratio=100.0))
    prof.set_function("m", cost_T)
    base = cost_T(1, 1, 256)
    seen = []
    for _ in range(6):
        prof.observe("m", 1, 1, 256, 3 * base)
        seen.append(prof.predict("m", 1, 1, 256) / base)
    assert seen[0] > 1.3 and seen[-1] > 2.5  # alpha 0.3 in log space: 3^(1-0.7^6) = 2.6
    # noise does not make it wander: +-20% jitter around 1x stays within 15%
    rng = random.Random(0)
    prof.set_function("m", cost_T)
    for _ in range(200):
        prof.observe("m", 1, 1, 256, base * rng.uniform(0.8, 1.2))
        assert 0.85 < prof.predict("m", 1, 1, 256) / base < 1.15


def test_profile_shape_refines_a_wrong_cell_slowly_and_many_shapes():
    prof = CostProfile()
    prof.set_function("m", cost_d1)
    # the engine's draft steps (t=1) cost 20% more than swept; verification (t=5) as swept
    for _ in range(300):
        prof.observe("m", 1, 1, 256, 1.2 * cost_d1(1, 1, 256), count=1)
        prof.observe("m", 1, 5, 256, cost_d1(1, 5, 256))
    assert prof.predict("m", 1, 1, 256) == pytest.approx(1.2 * cost_d1(1, 1, 256), rel=0.03)
    assert prof.predict("m", 1, 5, 256) == pytest.approx(cost_d1(1, 5, 256), rel=0.03)
    prof.observe_many("m", [(1, 3, 256), (1, 1, 256), (1, 1, 257)], 0.0)  # ignored
    prof.observe("unknown", 1, 1, 1, 1.0)  # ignored


def test_profile_observation_interpolates_each_shape_once(monkeypatch):
    """The router observes every forward of every engine step: `observe_many` reads each
    distinct shape's grid corners once, for the base and for the residual's cells, with the
    values of reading them twice (the reference below). Negative control: the two-pass
    observation interpolated 2 times per shape."""
    from specrouter.router import profile as profile_module

    def two_pass(prof, name, shapes, seconds):  # the reference: shape_at, then the corners again
        m = prof._models[name]
        cfg = prof.config
        base = sum(m.shape_at(*s) for s in shapes)
        log_ratio = math.log(seconds / base) - math.log(m.speed)
        m.speed *= math.exp(cfg.ema_alpha * log_ratio)
        share = cfg.shape_alpha * math.log(seconds / (m.speed * base)) / len(shapes)
        for s in shapes:
            for cell, w in profile_module._corners(m, *s):
                m.seconds[cell] *= math.exp(share * min(max(w, 0.0), 1.0))

    fast, ref = CostProfile(), CostProfile()
    for prof in (fast, ref):
        prof.set_function("m", cost_T)
    shapes = [(2, 1, 300), (2, 1, 300), (3, 5, 700)]
    for seconds in (1.1, 0.95, 1.05):  # within the jump ratio: the EMA and shape paths only
        total = seconds * sum(cost_T(*s) for s in shapes)
        fast.observe_many("m", shapes, total)
        two_pass(ref, "m", shapes, total)
    assert fast._models["m"].speed == ref._models["m"].speed
    assert np.array_equal(fast._models["m"].seconds, ref._models["m"].seconds)
    calls = []
    corners = profile_module._corners
    monkeypatch.setattr(profile_module, "_corners", lambda *a: calls.append(a[1:]) or corners(*a))
    fresh = [(2, 1, 301), (2, 1, 301), (3, 5, 701)]
    fast.observe_many("m", fresh, 1.02 * sum(cost_T(*s) for s in fresh))
    assert sorted(calls) == [(2, 1, 301), (3, 5, 701)]  # once per distinct shape
    fast.observe_many("m", shapes + fresh, 1.02 * sum(cost_T(*s) for s in shapes + fresh))
    assert len(calls) == 2  # and once per shape ever (`_ModelTable.corners`: they depend on the grid only)


def test_profile_save_load_round_trip(tmp_path, monkeypatch):
    prof = swept_profile()
    fp = {"cpu": "test-cpu", "threads": 2, "torch": "x"}
    path = prof.save(tmp_path / "p.json", fingerprint=fp)
    loaded = CostProfile.load(path, fingerprint=fp)
    assert sorted(loaded.models) == sorted(prof.models)
    for m in prof.models:
        assert loaded.identity(m) == prof.identity(m)
        assert loaded.cost_row(m, 2, 600, 18) == pytest.approx(prof.cost_row(m, 2, 600, 18))
    # another machine, or another model identity, does not match
    assert CostProfile.load(path, fingerprint={**fp, "threads": 8}).models == []
    only = CostProfile.load(path, [ModelIdentity("T", SIZES["T"], "float32"), ModelIdentity("d1", 5, "bf16")], fingerprint=fp)
    assert only.models == ["T"]
    assert only.missing([ModelIdentity("d1", 5, "bf16"), ModelIdentity("T", SIZES["T"], "float32")]) == [ModelIdentity("d1", 5, "bf16")]
    # a second machine's entry is merged in, not overwritten
    other = CostProfile()
    other.set_function("T", cost_T, identity=ModelIdentity("T", 1, "bf16"))
    other.save(path, fingerprint={"cpu": "other"})
    doc = json.loads(path.read_text())
    assert len(doc["machines"]) == 2
    assert CostProfile.load(path, fingerprint=fp).models  # still there
    # a corrupt file reads as empty
    (tmp_path / "bad.json").write_text("{not json")
    assert CostProfile.load(tmp_path / "bad.json", fingerprint=fp).models == []
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path / "c"))
    assert default_profile_path() == tmp_path / "c" / "profiles.json"


def test_profile_fingerprint_follows_the_kernels_sources(tmp_path, monkeypatch):
    """A kernel made faster under the same kernels() name changes the fingerprint (a digest of
    the kernels' sources), so the profile swept before it is not reused; the same sources
    reuse it."""
    from specrouter.models import runners
    from specrouter.router import profile as profile_mod

    fp = profile_mod.machine_fingerprint()
    assert len(fp["kernel_sources"]) == 12 and fp["kernel_sources"] == profile_mod.kernel_sources()
    path = swept_profile().save(tmp_path / "p.json", fingerprint=fp)
    assert "T" in CostProfile.load(path, fingerprint=profile_mod.machine_fingerprint())
    # the same package with one kernel source edited: another digest, nothing reused
    src = tmp_path / "runners"
    (src / "kernels").mkdir(parents=True)
    root = __import__("pathlib").Path(runners.__file__).parent
    for f in [*root.glob("kernels/*.cpp"), *root.glob("kernels/*.py"), *root.glob("*.py")]:
        (src / f.relative_to(root)).write_bytes(f.read_bytes())
    monkeypatch.setattr(runners, "__file__", str(src / "__init__.py"))
    assert profile_mod.kernel_sources() == fp["kernel_sources"]  # a copy: the same digest
    (src / "kernels" / "linear512.cpp").write_bytes((root / "kernels" / "linear512.cpp").read_bytes() + b"// faster\n")
    edited = profile_mod.machine_fingerprint()
    assert edited["kernel_sources"] != fp["kernel_sources"]
    assert CostProfile.load(path, fingerprint=edited).models == []


# ---------------------------------------------------------------------------------------------
# similarity


def test_tv_distance_and_masks():
    draft = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], [[0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]])  # (2, 2, 3)
    verifier = torch.tensor([[[0.5, 0.0, 0.5], [0.0, 1.0, 0.0], [1, 0, 0]],
                             [[0.2, 0.3, 0.5], [0.0, 0.5, 0.5], [1, 0, 0]]])  # (2, 3, 3): + bonus position
    mask = candidate_mask(torch.tensor([2, 1]), 2)
    assert mask.tolist() == [[True, True], [True, False]]
    tv = tv_distance(draft, verifier, mask)
    assert tv.tolist() == pytest.approx([(0.5 + 1.0) / 2, 0.0])
    assert math.isnan(tv_distance(draft, verifier, candidate_mask(torch.tensor([0, 0]), 2))[0])
    assert candidate_tv(draft, verifier, torch.tensor([2, 1])).tolist() == pytest.approx([0.75, 0.0])
    logits = torch.randn(2, 2, 3, dtype=torch.float64)
    assert tv_from_logits(logits, logits, mask).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    # one-hot draft (n-gram): D_TV = 1 - verifier_probs[token], the sampling acceptance
    onehot = torch.nn.functional.one_hot(torch.tensor([[2, 0]]), 3).float()
    v = torch.tensor([[[0.1, 0.2, 0.7], [0.6, 0.4, 0.0]]])
    assert tv_distance(onehot, v, torch.ones(1, 2, dtype=torch.bool)).item() == pytest.approx((0.3 + 0.4) / 2)


def test_acceptance_trials_and_shadow_match():
    assert acceptance_trials(4, 4) == (4, 0)  # all accepted: censored, no rejection
    assert acceptance_trials(4, 2) == (2, 1)
    assert acceptance_trials(0, 0) == (0, 0)
    assert acceptance_trials(3, 3, proposal_len=8) == (3, 1)  # a short model-free proposal
    assert shadow_match([5, 6, 7], [5, 6, 9, 1], k=8) == (2, 1)
    assert shadow_match([5, 6], [5, 6, 9], k=8) == (2, 1)  # ran out before the target stopped
    assert shadow_match([5, 6, 7], [5, 6], k=8) == (2, 0)  # the cycle committed only 2
    assert shadow_match([], [1], k=8) == (0, 0)


def test_shadow_against_a_model_drafter_feeds_that_pair_not_the_hit_rate():
    router = make_router(["ngram", "d1", "T"])
    sim = router.similarity
    before = sim.stats(("ngram", "d1"), GREEDY).trials
    hits = sim.hit_rate("ngram")
    router.observe_shadow(7, "ngram", [5, 6, 7], [5, 6, 9, 1], 4, True, verifier="d1", count_hit=False)
    assert sim.stats(("ngram", "d1"), GREEDY).trials == pytest.approx(before + 3)
    assert sim.hit_rate("ngram") == hits
    assert router.requests[7].counts[("ngram", "d1")] == [2.0, 1.0]
    router.observe_shadow(7, "ngram", [5], [5], 1, True, verifier="nope", count_hit=False)  # no such pair


def test_truncated_geometric_mle_is_unbiased():
    rng = random.Random(1)
    for alpha in (0.1, 0.5, 0.9):
        acc = rej = 0
        for _ in range(4000):
            n = rng.randint(1, 8)
            a = 0
            while a < n and rng.random() < alpha:
                a += 1
            x, y = acceptance_trials(n, a)
            acc, rej = acc + x, rej + y
        assert acc / (acc + rej) == pytest.approx(alpha, abs=0.02)


def test_alpha_prefers_observed_then_similarity_then_transitive_then_prior():
    est = SimilarityEstimator(SIZES, {"ngram"})
    pair = ("d1", "T")
    a, src = est.alpha_detail(pair, SAMPLING)
    assert src == "prior" and a == pytest.approx(0.75 + 0.1 * math.log10(10 / 400))
    assert est.alpha(("ngram", "T"), GREEDY) == pytest.approx(0.2)  # model-free: low prior
    # transitive: SimScore(d1, T) >= SimScore(d1, d2) + SimScore(d2, T) - 1
    est.observe_tv(("d1", "d2"), SAMPLING, 0.2, 50)
    est.observe_tv(("d2", "T"), SAMPLING, 0.1, 50)
    a, src = est.alpha_detail(pair, SAMPLING)
    assert src == "transitive" and a == pytest.approx(0.7)
    est.observe_tv(pair, SAMPLING, 0.4, 50)
    a, src = est.alpha_detail(pair, SAMPLING)
    assert src == "similarity" and a == pytest.approx(0.6)  # sampling: identity at start
    est.observe_acceptance(pair, SAMPLING, 5, 5)  # thin evidence: blended
    a, src = est.alpha_detail(pair, SAMPLING)
    assert src == "blend" and 0.5 < a < 0.6
    for _ in range(40):
        est.observe_acceptance(pair, SAMPLING, 3, 2)
    a, src = est.alpha_detail(pair, SAMPLING)
    assert src == "observed" and a == pytest.approx(0.6, abs=0.005)  # the early 5/5 has decayed
    assert blend(0, 0, 0.3, 4, 64) == 0.3 and blend(60, 40, 0.3, 4, 64) == pytest.approx(0.6)


def test_greedy_calibration_learns_from_observed_acceptance():
    est = SimilarityEstimator()
    assert est.calibrate(0.8, GREEDY) == pytest.approx(0.75)  # the shrunk prior
    assert est.calibrate(0.8, SAMPLING) == pytest.approx(0.8)
    # truth: greedy acceptance = 0.9 * SimScore - 0.1, seen on three pairs
    for _ in range(300):
        for pair, sim in ((("a", "t"), 0.9), (("b", "t"), 0.6), (("c", "t"), 0.4)):
            est.observe_tv(pair, GREEDY, 1 - sim, 16)
            alpha = 0.9 * sim - 0.1
            est.observe_acceptance(pair, GREEDY, 10 * alpha, 10 * (1 - alpha), sim)  # with its own SimScore
    for sim in (0.5, 0.8):
        assert est.calibrate(sim, GREEDY) == pytest.approx(0.9 * sim - 0.1, abs=0.02)
    # a fourth pair measured only by D_TV gets the calibrated value
    est.observe_tv(("e", "t"), GREEDY, 0.3, 16)
    assert est.alpha(("e", "t"), GREEDY) == pytest.approx(0.9 * 0.7 - 0.1, abs=0.02)


def test_needs_probe_and_budget():
    est = SimilarityEstimator()
    assert est.needs_probe(("a", "t"), GREEDY) and est.upper(("a", "t"), GREEDY) == 1.0
    est.observe_acceptance(("a", "t"), GREEDY, 60, 40)  # 100 trials, fading over 200 row-cycles
    est.observe_acceptance(("b", "t"), GREEDY, 10, 6)  # 16 trials: under min_evidence (64)
    assert not est.needs_probe(("a", "t"), GREEDY) and est.needs_probe(("b", "t"), GREEDY)
    assert est.upper(("b", "t"), GREEDY) > est.alpha(("b", "t"), GREEDY) + 0.1  # optimism
    est.tick(71)
    assert not est.needs_probe(("a", "t"), GREEDY)  # 100 * (1 - 71/200) = 64.5
    est.tick(2)
    assert est.needs_probe(("a", "t"), GREEDY)
    assert est.upper(("a", "t"), GREEDY) > est.alpha(("a", "t"), GREEDY)
    # the budget: never more than 5% of row-cycles, nor 2% of the wall time
    budget = ProbeBudget(fraction=0.05, time_fraction=None)
    for _ in range(2000):
        if budget.allow():
            budget.charge(0.001)
        budget.tick(1, 0.05)
        assert budget.probes <= 0.05 * budget.cycles + 1e-9
    assert budget.probes == 100 and budget.seconds == pytest.approx(0.1)
    budget = ProbeBudget(fraction=1.0, time_fraction=0.02)
    for _ in range(1000):
        if budget.allow():
            budget.charge(0.01)
        budget.tick(1, 0.05)
    assert budget.seconds <= 0.02 * budget.total_seconds + 0.01
    assert budget.probes >= 90


# ---------------------------------------------------------------------------------------------
# router: decisions


def _feed_truth(router, alphas, hit, mode=GREEDY):
    for pair, a in alphas.items():
        router.similarity.observe_acceptance(pair, mode, 1000 * a, 1000 * (1 - a))
    router.similarity.observe_hits("ngram", 400 * hit, 400)


@pytest.mark.parametrize("b,L,alphas,hit", [
    (1, 256, ALPHAS, HIT),
    (4, 1500, ALPHAS, HIT),
    (1, 256, {**ALPHAS, ("ngram", "T"): 0.95}, 0.9),
    (1, 256, {p: 0.02 for p in ALPHAS}, 0.0),
    (8, 512, {**ALPHAS, ("d1", "T"): 0.8}, HIT),
])
def test_router_picks_the_closed_form_optimum(b, L, alphas, hit):
    router = make_router(timer=lambda: 0.0)
    _feed_truth(router, alphas, hit)
    d = router.decide(RowContext(0, L, batch_size=b, greedy=True))
    truth = true_plan(ORDER4, alphas, hit, b=b, L=L)
    assert (d.chain, d.k) == (truth.chain, truth.k)
    assert d.t_eff == pytest.approx(truth.t_eff, rel=1e-2)  # the router reads T_M at its L bucket
    assert len(router.chains) == 8 and router.chains[0] == ("T",)


def test_router_learns_the_optimum_online():
    sim = Sim(ALPHAS, seed=3, overhead_spec=0.0, overhead_plain=0.0)
    router = make_router(timer=lambda: 0.0)
    trace = []
    drive(router, sim, 600, trace=trace)  # the 3-level optimum is found by probing (5% budget)
    truth = true_plan(ORDER4, ALPHAS)
    final = [t[0] for t in trace[-100:]]
    picked = [d for d in final if d.reason != "probe"]
    assert all(d.chain == truth.chain for d in picked), {d.chain for d in picked}
    worst = max(true_t_eff(truth.table, d.chain, d.k) for d in picked)
    assert worst <= truth.t_eff * 1.03
    print(f"\noptimum {truth.chain} k={truth.k}; router ran k in {sorted({d.k for d in picked})}")


def test_router_follows_a_3x_slowdown_within_20_cycles():
    """d2 (the middle level of the optimal chain) is slow, recovers, and slows down 3x again."""
    sim = Sim(ALPHAS, seed=2)
    router = make_router()
    fast = true_plan(ORDER4, ALPHAS)
    slow = true_plan(ORDER4, ALPHAS, slow={"d2": 3.0})
    assert fast.chain == ("d1", "d2", "T") and slow.chain == ("d1", "T")
    # 1. d2 is 3x slower than swept from the start: the router settles on d1 -> T
    sim.slow["d2"] = 3.0
    trace = []
    drive(router, sim, 300, trace=trace)
    assert trace[-1][0].chain == slow.chain
    assert router.profile.speed("d2") == pytest.approx(3.0, rel=0.1)
    # 2. d2 recovers while unused: probes re-time it and the router returns to d1 -> d2 -> T
    sim.slow["d2"] = 1.0
    trace = []
    drive(router, sim, 600, trace=trace)
    chains = [t[0].chain for t in trace if t[0].reason != "probe"]
    assert all(c == fast.chain for c in chains[-100:])
    print(f"\nrecovered: back on {fast.chain} after {chains.index(fast.chain) + 1} cycles")
    # 3. d2, now in use, slows down 3x: the router moves within 20 cycles and stays
    sim.slow["d2"] = 3.0
    trace = []
    drive(router, sim, 60, trace=trace)
    chains = [t[0].chain for t in trace if t[0].reason != "probe"]
    first = chains.index(slow.chain)
    assert first < 20 and all(c == slow.chain for c in chains[first:]), chains
    assert router.profile.speed("d2") == pytest.approx(3.0, rel=0.15)
    print(f"3x slowdown of d2: {fast.chain} -> {slow.chain} after {first + 1} cycles")


@pytest.mark.parametrize("charge", [True, False])
def test_draft_step_host_time_is_learned_and_shortens_the_draft(charge):
    """Issue 33: every model draft step after the first costs host seconds outside its forward
    (on a GPU a sync per step). The router learns them per step from the step reports and
    charges k - 1 of them to a draft of length k: it settles on the closed-form optimum with
    them, a shorter draft than the optimum without. The negative control: told only the
    cycle's total (the executor before the fix), it averages them into a per-cycle overhead
    that does not grow with k and keeps the longer draft (the old rule, patched in below:
    `RouterConfig(draft_step_overhead=False)` until prune24 removed it, issue 27)."""
    order, alphas, step = ["d1", "T"], {("d1", "T"): 0.8}, 0.004
    sim = Sim(alphas, seed=4, overhead_spec=0.0, overhead_plain=0.0, draft_step_host=step)
    router = make_router(order, timer=lambda: 0.0)
    trace = []
    with pytest.MonkeyPatch.context() as mp:
        if not charge:  # the old rule: the overheads see no draft steps (their seconds stay in the wall)
            real = Router._observe_overhead
            mp.setattr(Router, "_observe_overhead", lambda self, report: real(
                self, dataclasses.replace(report, draft_steps=0, draft_host_seconds=0.0)))
        drive(router, sim, 300, trace=trace)
    charged, uncharged = true_plan(order, alphas, draft_step=step), true_plan(order, alphas)
    assert charged.chain == uncharged.chain == ("d1", "T") and charged.k < uncharged.k
    ks = [t[0].k for t in trace[-50:] if t[0].reason != "probe"]
    want = charged.k if charge else uncharged.k
    assert abs(sum(ks) / len(ks) - want) <= 1, (ks, charged.k, uncharged.k)
    if charge:
        assert router.overhead["draft_step"] == pytest.approx(step, rel=1e-6)
        assert router.overhead["spec"] == pytest.approx(0.0, abs=1e-9)
    else:
        assert router.overhead["draft_step"] == 0.0 and router.overhead["spec"] > step
    print(f"\nper-step host {step * 1e3:.1f} ms: optimum k={charged.k} (k={uncharged.k} uncharged); "
          f"router ran k in {sorted({int(k) for k in ks})}")


@pytest.mark.slow  # the router's real decide() time is on the clock: 0.956x alone on quiet cores,
# under 0.95 inside the full suite on 2 cores; run by `make test-slow` on quiet cores
def test_useless_drafts_fall_back_to_plain_decoding_within_5_percent():
    useless = {p: 0.0 for p in ALPHAS}
    sim = Sim(useless, hit=0.0, seed=5)
    router = make_router(timer=time.perf_counter)  # the router's real decide() time is on the clock
    trace = []
    tokens, seconds = drive(router, sim, 500, trace=trace)
    plain_tokens = 500
    plain_seconds = 500 * (cost_T(1, 1, L0) + sim.overhead["plain"])
    ratio = (tokens / seconds) / (plain_tokens / plain_seconds)
    assert trace[-1][0].chain == ("T",) or trace[-1][0].reason == "probe"
    probes = sum(t[0].reason == "probe" for t in trace)
    print(f"\nuseless drafts: {ratio:.4f}x plain decoding tokens/s, {probes} probes")
    assert ratio >= 0.95


@pytest.mark.parametrize("check", [True, False])
def test_the_realized_check_leaves_a_lookup_that_never_delivers(check, monkeypatch):
    """Step 1b. The estimates say the n-gram lookup is excellent (hit rate 0.9, alpha 0.95), but
    in this request every lookup cycle commits one token at plain decoding's price, and the
    estimators never see why (the executor reports a plain step, and no shadow score tells
    the miss). With the realized check the request leaves ngram -> T within a few cycles for
    a model chain, and tries it again only as the penalty fades (`realized_fade`, ~1 cycle in
    20 here); without it (the negative control: `Router._observe_realized` a no-op, as
    `realized_check=False` was) it stays on the lookup to the end."""
    if not check:
        monkeypatch.setattr(Router, "_observe_realized", lambda self, req, r, wall_time: None)
    sim = Sim(ALPHAS, seed=4)
    router = make_router()
    _feed_truth(router, {**ALPHAS, ("ngram", "T"): 0.95}, 0.9)
    ctx = RowContext(0, L0)
    chains = []
    for _ in range(40):
        d = router.decide(ctx)
        chains.append(d.chain)
        if d.chain[0] == "ngram":  # the lookup proposed nothing: a plain step on its account
            seconds = cost_T(1, 1, L0)
            router.observe_step(StepReport([RowOutcome(0, ("T",), 0, [0], [0], True, L0)],
                                           [ForwardRecord("T", 1, 1, L0, seconds)], seconds + 1e-4, seconds, False))
        else:
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0)
            observe_cycle(router, stats, outcomes, fwd)
    lookup = sum(c[0] == "ngram" for c in chains[-20:])
    if check:
        assert chains[0][0] == "ngram" and lookup <= 3, chains
        assert router.requests[0].corrections[chains[0]] > 1.5
    else:
        assert lookup == 20, chains


def test_hysteresis_does_not_flap_between_near_equal_plans():
    # two two-level chains within ~0.1% of each other: d1 -> T and d2 -> T
    order = ["d1", "d2", "T"]
    alphas = {("d1", "T"): 0.65, ("d2", "T"): 0.84, ("d1", "d2"): 0.05}
    truth = true_plan(order, alphas)
    t = truth.table
    best_d1 = t.t_eff[t.chains.index(("d1", "T"))].min()
    best_d2 = t.t_eff[t.chains.index(("d2", "T"))].min()
    assert abs(best_d1 / best_d2 - 1) < 0.002

    def switches(config):
        sim = Sim(alphas, seed=6)
        router = make_router(order, config=config, timer=lambda: 0.0)
        trace = []
        drive(router, sim, 500, trace=trace)
        plans = [(t[0].chain, t[0].k) for t in trace[100:] if t[0].reason != "probe"]
        return sum(a[0] != b[0] for a, b in zip(plans, plans[1:])), sum(a != b for a, b in zip(plans, plans[1:]))

    # probes as before the refute back-off (probing.py `Prober.judge`): their trials are the
    # noise that makes the unhysteretic control flap, and with fewer of them it flapped 3 times;
    # the request's own evidence of the pair it does not run kept (no idle fade, policy.py
    # `fade_idle`): faded toward its prior, the probes' trials move it less, and it flapped 0 times
    chain_sw, plan_sw = switches(RouterConfig(probe_refute_wait=0, request_idle_decay=1.0))
    raw_chain, raw_plan = switches(RouterConfig(switch_margin=0.0, patience=1, probe_refute_wait=0,
                                                request_idle_decay=1.0))
    print(f"\nchain/plan switches over 400 cycles: hysteresis {chain_sw}/{plan_sw}, none {raw_chain}/{raw_plan}")
    assert chain_sw <= 3 and plan_sw <= 10
    assert raw_plan > 3 * max(plan_sw, 1)


def test_per_request_chains_differ_by_request_type():
    order = ["ngram", "d1", "T"]
    alphas = {("d1", "T"): 0.6, ("ngram", "T"): 0.5, ("ngram", "d1"): 0.5}
    sim = Sim(alphas, seed=7)
    sim.per_request[0] = {"alphas": {("ngram", "T"): 0.92, ("ngram", "d1"): 0.9}, "hit": 0.95}  # code
    sim.per_request[1] = {"alphas": {("ngram", "T"): 0.1, ("ngram", "d1"): 0.1}, "hit": 0.3}  # prose
    router = make_router(order)
    trace = []
    drive(router, sim, 300, sids=(0, 1), shadow=True, trace=trace)
    last = [t for t in trace[-50:]]
    code = {t[0].chain for t in last if t[0].reason != "probe"}
    prose = {t[1].chain for t in last if t[1].reason != "probe"}
    code_truth = true_plan(order, {**alphas, ("ngram", "T"): 0.92, ("ngram", "d1"): 0.9}, 0.95, b=2)
    prose_truth = true_plan(order, {**alphas, ("ngram", "T"): 0.1, ("ngram", "d1"): 0.1}, 0.3, b=2)
    assert code_truth.chain[0] == "ngram" and prose_truth.chain == ("d1", "T")
    assert code == {code_truth.chain} and prose == {prose_truth.chain}
    router.finish_request(0)
    assert 0 not in router.requests


@pytest.mark.parametrize("first", [True, False])
def test_a_pair_with_a_bad_start_is_probed_by_a_chain_it_starts(first, monkeypatch):
    """An early unlucky streak (16 of 16 rejected) leaves d1 > T at a low alpha. Probes of the
    pair run a chain that starts with it (d1 drafts, T verifies every candidate), never
    ngram > d1 > T, whose n-gram misses teach the pair nothing; the negative control (the old
    rule, every chain measuring the pair: was `probe_first_pair=False`) probes it behind the
    n-gram, the optimistic best here."""
    if not first:
        monkeypatch.setattr(Prober, "first_pair_chains", lambda self, pair: self.router.pair_chains[pair])
    order = ["ngram", "d1", "T"]
    alphas = {("d1", "T"): 0.8, ("ngram", "T"): 0.6, ("ngram", "d1"): 0.9}
    sim = Sim(alphas, hit=0.6, seed=6, overhead_spec=0.0, overhead_plain=0.0)
    router = make_router(order, timer=lambda: 0.0)
    router.similarity.observe_acceptance(("d1", "T"), GREEDY, 0, 16)  # the unlucky start
    router.similarity.observe_acceptance(("ngram", "d1"), GREEDY, 900, 100)  # known: probes are d1 > T's
    trace = []
    drive(router, sim, 150, trace=trace)
    probes = [t[0].chain for t in trace if t[0].reason == "probe"]
    measuring = [c for c in probes if ("d1", "T") in zip(c[:-1], c[1:])]
    assert measuring
    if first:
        assert all(c[:2] == ("d1", "T") for c in measuring), measuring
    else:
        assert ("ngram", "d1", "T") in measuring
    print(f"\nprobes of d1>T: {sorted(set(measuring))}")


def test_confirmed_tokens_lead_to_the_three_level_chain():
    """T accepts the tokens the n-gram and d1 agree on at 0.95, d1's own at 0.3 (cost_model.py,
    point 4). Running d1 > T, the router shadow-scores the n-gram against d1's drafts, which
    teaches it the triple (ngram, d1, T) for free: it moves to ngram > d1 > T within a few
    cycles, runs it most of the time and decodes faster. The negative control, side by side on
    the same world and seed (the iid model: ngram > d1 > T predicted at d1's rate; the router
    without its triples, as `confirmed_alpha=False` was before lead23 removed it), never runs it
    outside probes."""
    order = ["ngram", "d1", "T"]
    alphas = {("d1", "T"): 0.3, ("ngram", "T"): 0.5, ("ngram", "d1"): 0.6}
    three = ("ngram", "d1", "T")
    runs = {}
    for on in (True, False):
        sim = Sim(alphas, hit=0.7, seed=11, overhead_spec=0.0, overhead_plain=0.0)
        sim.confirmed = {three: 0.95}
        router = make_router(order, timer=lambda: 0.0)
        if not on:
            router.triples = []  # the iid model: no triple estimated apart
        trace = []
        tokens, seconds = drive(router, sim, 300, trace=trace, shadow=True, timed=False)
        runs[on] = ([t[0].chain for t in trace if t[0].reason != "probe"], tokens / seconds, router)
    (chains, speed, router), (iid_chains, iid_speed, iid_router) = runs[True], runs[False]
    assert chains.index(three) < 20 and chains[-100:].count(three) >= 60, chains[-100:]
    assert router.alpha(three, GREEDY) > 0.85 and router.similarity.stats(three, GREEDY).trials > 100
    assert speed > 1.05 * iid_speed
    assert three not in iid_chains and not iid_router.triples
    print(f"\nlast 100 cycles on {three}: {chains[-100:].count(three)}; {speed:.1f} vs {iid_speed:.1f} tok/s (iid)")


def test_new_requests_start_from_an_upper_quantile_of_finished_requests():
    """A stream mixing a type that accepts the draft well (0.7) with one that does not (0.1):
    the global alpha is the mean of neither; a new request's prior is the 0.75 quantile of what
    finished requests reached, so a good-type request tries the draft at once."""
    order = ["d1", "T"]
    router = make_router(order)
    pair = ("d1", "T")
    for sid, rate in enumerate([0.1, 0.7, 0.1, 0.7, 0.1, 0.7, 0.1, 0.7]):
        req = router.request(sid, True)
        req.counts[pair] = [40 * rate, 40 * (1 - rate)]
        router.similarity.observe_acceptance(pair, GREEDY, 40 * rate, 40 * (1 - rate))
        router.finish_request(sid)
    glob = router.similarity.alpha(pair, GREEDY)
    assert 0.2 < glob < 0.6
    fresh = router.request(100, True)
    assert router.alpha(pair, GREEDY, fresh) == pytest.approx(0.7)
    assert router.alpha(pair, GREEDY) == glob  # the global estimate itself is unchanged
    fresh.counts[pair] = [0.0, 30.0]  # its own evidence soon dominates
    assert router.alpha(pair, GREEDY, fresh) < 0.2
    # before request_min_finished (3) finished requests, the global alpha; from the third, their quantile
    few = make_router(order)
    for sid in range(2):
        few.request(sid, True).counts[pair] = [28.0, 12.0]
        few.finish_request(sid)
    few.similarity.observe_acceptance(pair, GREEDY, 10, 30)
    assert few.alpha(pair, GREEDY, few.request(5, True)) == few.similarity.alpha(pair, GREEDY)
    few.request(2, True).counts[pair] = [28.0, 12.0]
    few.finish_request(2)
    assert few.alpha(pair, GREEDY, few.request(6, True)) == pytest.approx(0.7)
    for bad in (None, 1.5, True):  # None (the global alpha always) was removed by prune24, issue 27
        with pytest.raises(ValueError, match="request_prior_quantile"):
            RouterConfig(request_prior_quantile=bad)


def test_probing_stays_within_budget_and_refreshes_pairs():
    sim = Sim(ALPHAS, seed=8)
    router = make_router(config=RouterConfig(probe_time_fraction=None))
    trace = []
    drive(router, sim, 500, sids=(0, 1), trace=trace)
    decisions = [d for t in trace for d in t.values()]
    probes = sum(d.reason == "probe" for d in decisions)
    assert 0 < probes <= 0.05 * len(decisions)
    # the probes measured pairs outside the running chains
    probed = {d.chain for d in decisions if d.reason == "probe"}
    running = {d.chain for d in decisions if d.reason != "probe"}
    assert probed - running
    # with the time cap, the accounted probe seconds stay under 2% of the wall time
    sim = Sim(ALPHAS, seed=9)
    router = make_router()
    drive(router, sim, 400)
    b = router.prober.budget
    assert b.seconds <= 0.02 * b.total_seconds + max(b.history, default=0.0)
    assert b.probes <= 0.05 * b.cycles


def test_decision_events_and_callback():
    seen = []
    router = make_router(on_decision=seen.append)
    sim = Sim(ALPHAS, seed=10)
    drive(router, sim, 30)
    assert len(seen) == 30 and list(router.events) == seen
    e = seen[-1]
    assert e.mode == GREEDY and e.batch_size == 1 and e.context_len == L0
    assert set(e.alphas) == {*router.pairs, *router.triples} and e.plain_t_eff > 0 and e.decide_seconds >= 0
    assert seen[0].reason == "initial"
    # the end of a request: no room for a draft
    d = router.decide(RowContext(0, L0, remaining=1))
    assert d == Decision(("T",), 0, pytest.approx(cost_T(1, 1, L0), rel=0.05), "end")
    print("\n" + router.plan_table(RowContext(0, L0)).format())


def test_decide_time_is_measured_and_charged_per_row():
    """The router's own time is decide()'s: decide() measures itself
    (its timer), and every plan's T_eff carries that time once per batch row per cycle, so a
    slow router never makes plain decoding look free. (How fast decide() is:
    benchmarks/router_decide.py.)"""
    rows = [RowContext(s, L0 + 7 * s, batch_size=4) for s in range(4)]
    trained = make_router()
    drive(trained, Sim(ALPHAS, seed=12), 30, sids=range(4), timed=False)
    events = {}
    for step in (1e-4, 3e-3):
        router = copy.deepcopy(trained)  # the same estimates; only decide()'s own time differs
        router.timer, router.decide_seconds = StepTimer(step), 0.0
        # every change of decide()'s time is published (the default waits for a material one)
        router.config = dataclasses.replace(router.config, decision_time_tolerance=0.0)
        for i in range(8):
            router.decide(rows[i % 4])
        assert router.decide_seconds == pytest.approx(step, rel=1e-9)
        assert router.events[-1].decide_seconds == pytest.approx(step, rel=1e-9)
        events[step] = router.events[-1]
        events[step, "table"] = router.evaluate(rows[3], router.requests[3])[0]
    slow, fast = events[3e-3], events[1e-4]
    # plain decoding: one token per cycle, so the router's b * decide time is added in full
    assert slow.plain_t_eff - fast.plain_t_eff == pytest.approx(4 * (3e-3 - 1e-4), rel=1e-6)
    # a speculative plan: the same time per cycle, spread over its expected tokens
    t_slow, t_fast = events[3e-3, "table"], events[1e-4, "table"]
    i = t_slow.chains.index(("d1", "d2", "T"))
    gap = t_slow.t_eff[i, 3] - t_fast.t_eff[i, 3]
    assert gap == pytest.approx(4 * (3e-3 - 1e-4) / t_slow.expected_tokens[i, 3], rel=1e-3)


def test_outside_clock_pairs_each_step_with_its_planning():
    """A step's host seconds outside the executor: from one planning to the next, minus the
    executor's wall of the step planned; only between consecutive steps of the same rows, at
    most the executor's wall; whether a hold planned the step (no decide) or it was decided."""
    rows = [RowContext(0, L0)]
    clock = OutsideClock()
    assert clock.planning(0.0, 0, rows) is None  # nothing planned before
    clock.observed(0, 0.010, True)
    assert clock.planning(0.012, 1, rows) == pytest.approx((0.002, True, False))
    clock.observed(1, 0.008, False)
    assert clock.planning(0.021, 2, rows) == pytest.approx((0.001, False, False))
    clock.held()  # the step planned at 0.021 was a held one
    clock.observed(2, 0.008, False)
    assert clock.planning(0.0295, 3, rows) == pytest.approx((0.0005, False, True))
    clock.observed(3, 0.008, False)
    assert clock.planning(0.038, 4, rows) == pytest.approx((0.0005, False, False))
    assert clock.planning(0.040, 4, rows) is None  # the step was not observed: no pairing
    clock.observed(4, 0.008, False)
    assert clock.planning(0.050, 5, [RowContext(1, L0)]) is None  # another request: not a step's
    clock.observed(5, 0.005, True)
    assert clock.planning(0.110, 6, [RowContext(1, L0)]) == pytest.approx((0.005, True, False))  # a stall: clipped
    clock.observed(6, 0.005, True)
    assert clock.planning(0.210, 8, [RowContext(1, L0)]) is None  # a step skipped


def test_host_time_outside_the_executor_is_measured_and_charged():
    """plan_batch measures each step's host seconds outside the executor with the step clock
    (plain and speculative steps apart) and every plan pays its kind's per cycle: plain one
    token's worth, a speculative plan spread over its expected tokens; without a step clock
    (simulated pools) nothing is measured. The plan table charges decide() alone (the measured
    seconds enter only where plain decoding is weighed against speculation, `PlainCharge`)."""
    now = [0.0]
    router = make_router(step_clock=lambda: now[0], timer=lambda: 0.0, config=RouterConfig(overhead_alpha=1.0))
    sim = Sim(ALPHAS, seed=3)
    row = RowContext(0, L0)
    for _ in range(40):
        d = router.plan_batch([row]).decisions[0]
        stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0, True)
        observe_cycle(router, stats, outcomes, fwd)
        now[0] += stats.wall_time + (0.003 if d.k > 0 else 0.001)  # outside: 3 ms speculative, 1 ms plain
    assert router.overhead["outside_spec"] == pytest.approx(0.003)  # the last measured (EMA weight 1)
    assert router.overhead["outside_plain"] in (0.0, pytest.approx(0.001))  # 0: no plain step measured
    unmeasured = make_router(timer=lambda: 0.0)  # no step clock
    unmeasured.plan_batch([row])
    assert unmeasured.overhead["outside_spec"] == unmeasured.overhead["outside_plain"] == 0.0

    def table(outside_plain, outside_spec, **config):
        r = make_router(timer=lambda: 0.0, config=RouterConfig(**config))
        r.overhead.update(outside_plain=outside_plain, outside_spec=outside_spec)
        r.board.changed()
        return r.evaluate(row)[0]

    # the plan table ignores the measured outside seconds (a table that charged them, as the removed
    # `charge_outside` did, gives other T_eff: this assert fails then)
    base, measured = table(0.0, 0.0), table(1e-3, 3e-3)
    i = base.chains.index(("d1", "d2", "T"))
    assert measured.t_eff[0, 0] == pytest.approx(base.t_eff[0, 0]) and measured.t_eff[i, 3] == pytest.approx(base.t_eff[i, 3])


def test_a_step_that_prefilled_is_not_a_cycle_of_the_outside_clock():
    """A step whose forward is wider than its plan (a prompt's prefill, a model catching up:
    `records.routing.widened`) is not measured by the outside clock: its host work grows with
    the prompt. Here the row's first step prefills with 40 ms outside the executor (a cold
    process, a server's first chunk); every later step has 3 ms (speculative) or 1 ms (plain):
    the router learns exactly those. Negative control: the same steps with the prefill's forward
    as wide as a cycle's seed the first step's kind at 40 ms (the EMA still remembers it)."""
    from specrouter.records.routing import widened

    plans = [RowOutcome(0, ("d1", "T"), 3, [3, 3], [0, 2])]
    assert widened(plans, [ForwardRecord("T", 1, 4, L0, 0.01)]) is False  # k + 1 candidates at the target
    assert widened(plans, [ForwardRecord("d1", 1, 40, 0, 0.01)]) is True  # d1 catching up 40 tokens
    assert widened([RowOutcome(0, ("T",), 0, [0], [0])], [ForwardRecord("T", 1, 3, 0, 0.01)]) is True

    def learned(prefill_width):
        now = [0.0]
        router = make_router(step_clock=lambda: now[0], timer=lambda: 0.0)
        sim = Sim(ALPHAS, seed=3)
        row = RowContext(0, L0)
        for step in range(40):
            d = router.plan_batch([row]).decisions[0]
            stats, outcomes, fwd, _ = sim.run(d.chain, d.k, [0], L0, True)
            if step == 0:  # the prefill: the target over the prompt
                fwd = [*fwd, ForwardRecord("T", 1, prefill_width, 0, 0.02)]
            observe_cycle(router, stats, outcomes, fwd)
            now[0] += stats.wall_time + (0.040 if step == 0 else 0.003 if d.k > 0 else 0.001)
        return router.overhead["outside_spec"], router.overhead["outside_plain"]

    spec, plain = learned(prefill_width=L0)
    assert spec == pytest.approx(0.003) and plain in (0.0, pytest.approx(0.001))
    control = learned(prefill_width=1)  # the same step, not recognised as a prefill
    assert max(control[0] - 0.003, control[1] - 0.001) > 3e-4  # 40 ms, faded by the EMA over 39 steps


def test_sampling_rows_feed_similarity_from_tv():
    """Sampling-mode rows carry per-level D_TV: the active pairs' SimScore is measured for free."""
    sim = Sim(ALPHAS, seed=13)
    router = make_router(config=RouterConfig(decision_margin_sampling=0.0))  # the estimates as they are
    for _ in range(20):
        stats, outcomes, fwd, _ = sim.run(("d1", "d2", "T"), 4, [0, 1], L0, greedy=False)
        tv = (math.nan, 1 - ALPHAS[("d1", "d2")], 1 - ALPHAS[("d2", "T")])
        router.observe_step(StepReport([RowOutcome(o.seq_id, o.chain, o.k, o.drafted, o.accepted, False, L0, tv)
                                        for o in outcomes], fwd, stats.wall_time, sum(stats.forward_time.values()), True))
    router.deferral.fold()  # deferred observations (lean20's default) are folded where read
    est = router.similarity
    assert est.sim_score(("d1", "d2"), SAMPLING) == pytest.approx(0.9)
    assert est.sim_score(("d2", "T"), SAMPLING) == pytest.approx(0.85)
    assert est.sim_score(("d1", "T"), SAMPLING) is None
    assert est.transitive_sim(("d1", "T"), SAMPLING) == pytest.approx(0.75)
    assert est.stats(("d1", "d2"), GREEDY).trials == 0  # modes are kept apart
    # (d1, T) was never run: its alpha is f(transitive SimScore) = 0.75 (the scripted 0.65 is
    # not a metric-consistent world; a real one obeys the triangle inequality)
    assert router.similarity.alpha_detail(("d1", "T"), SAMPLING) == (pytest.approx(0.75, abs=0.02), "transitive")
    # and decisions use it: a sampling row's (d1, T) alpha is that transitive estimate, a
    # greedy row's (nothing measured in greedy mode) the size prior
    router.decide(RowContext(0, L0, greedy=False))
    assert router.events[-1].mode == SAMPLING
    assert router.events[-1].alphas[("d1", "T")] == pytest.approx(0.75, abs=0.02)
    assert router.events[-1].alphas[("d1", "d2")] == pytest.approx(est.alpha(("d1", "d2"), SAMPLING), abs=0.05)
    router.decide(RowContext(1000, L0, greedy=True))
    assert router.events[-1].alphas[("d1", "T")] == pytest.approx(est.prior(("d1", "T")), abs=1e-4)
    assert est.prior(("d1", "T")) < 0.7


def test_edge_cases():
    # a model-free drafter's cost as an array indexed by k (what the router passes)
    row = np.array([0.0] + [1e-4 * k for k in range(1, 17)])
    a = ModelFreeDraft(cost=row, hit_rate=0.5).costs(np.arange(1, 17))
    b = ModelFreeDraft(cost=lambda k: 1e-4 * k, hit_rate=0.5).costs(np.arange(1, 17))
    assert a == pytest.approx(b)
    with pytest.raises(ValueError):
        ModelFreeDraft(cost=np.array([0.0, -1.0]))
    # a pool of the target alone: plain decoding, always
    router = Router(["T"], "T", swept_profile(("T",), ngram=False))
    assert router.decide(RowContext(0, 100)).chain == ("T",)
    with pytest.raises(ValueError, match="no cost profile"):
        Router(["d1", "T"], "T", swept_profile(("T",), ngram=False))
    with pytest.raises(ValueError):
        RouterConfig(k_max=17)


def test_router_config_reaches_every_part():
    """RouterConfig carries every router constant: the estimator's (similarity), the request
    memory's and the probing's settings get where they act."""
    from specrouter.config import SimilarityConfig

    sim_cfg = SimilarityConfig(model_free_prior=0.33, size_prior_base=0.6, greedy_calibration=(0.0, 1.0))
    cfg = RouterConfig(similarity=sim_cfg, request_min_finished=1, request_hit_prior_strength=0.0,
                       alpha_decimals=2)
    router = make_router(config=cfg)
    est = router.similarity
    assert est.config is sim_cfg
    assert est.prior(("ngram", "T")) == 0.33
    assert est.prior(("d1", "T")) == pytest.approx(0.6 + 0.1 * math.log10(10 / 400))
    assert est.calibrate(0.8, GREEDY) == pytest.approx(0.8)  # the identity prior line, no data
    assert router.finished.min_requests == 1
    req = router.request(5, True)
    req.observe_hit("ngram", True, cfg.request_hit_decay)
    assert router.hit_rate("ngram", req) == 1.0  # no pseudo-proposals of the global rate
    router.decide(RowContext(5, L0))
    assert all(round(a, 2) == a for a in router.events[-1].alphas.values())
    with pytest.raises(ValueError):
        SimilarityConfig(decay=1.5)
    with pytest.raises(ValueError):
        RouterConfig(shadow_k=0)


def test_the_sweep_widens_to_32_tokens_only_where_the_machine_makes_them_cheap():
    """A runner whose 32-token forward costs <= 3x its 1-token one gets the t = 32 column (every
    batch size and context), measured: the profile predicts it exactly and says n = 32 was swept;
    a runner where it costs more gets one probe cell and keeps the default grid (the tree
    policy's node cap follows: engine/tree_policy.py `TreePolicy.from_profile`)."""
    from specrouter.engine.tree_policy import TreePolicy

    flat = lambda b, t, L: 0.010 + 0.0002 * b * t + 1e-6 * L  # noqa: E731  T(32) = 1.6 T(1)
    steep = lambda b, t, L: 0.010 * b * t + 1e-6 * L  # noqa: E731  T(32) = 32 T(1)
    clock = VClock()
    prof = sweep({"flat": FakeRunner("flat", flat, clock, 1000), "steep": FakeRunner("steep", steep, clock, 1000)},
                 repeats=1, warmup=0, progress=False, clock=clock)
    assert prof.max_new_tokens("flat") == 32 and prof.max_new_tokens("steep") == 16
    for b, L in ((1, 128), (8, 1024), (4, 500)):
        assert prof.predict("flat", b, 32, L) == pytest.approx(flat(b, 32, L), rel=1e-9)
    assert TreePolicy.from_profile(prof, "flat", frozenset()).max_nodes == 31
    assert TreePolicy.from_profile(prof, "steep", frozenset()).max_nodes == 15
    # without widening (the old grid) the flat runner stops at 16 as well
    plain = sweep({"flat": FakeRunner("flat", flat, clock, 1000)}, repeats=1, warmup=0, progress=False,
                  clock=clock, wider_tokens=())
    assert plain.max_new_tokens("flat") == 16
