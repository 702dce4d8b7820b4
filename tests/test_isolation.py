"""One bad row never costs another (engine/isolation.py): a row whose preparation or sampling
raises in the middle of a running batch ends alone with finish_reason "error"; the rows batched
with it commit exactly their solo outputs, and no state leaks."""

import copy
import logging

import pytest
import torch
from fixtures import QuietRouterHooks, load_named_pool

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.records.routing import Decision

NAMES = ("draft", "mid", "target")
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100], [12, 250, 31, 77, 9]]
CHAIN = ("ngram", "draft", "mid", "target")
N = 24


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, NAMES)


@pytest.fixture(scope="module")
def solo(pool):
    """Each prompt alone, greedy, target only."""
    return {tuple(p): Engine(pool).generate_ids([p], [SamplingParams(max_new_tokens=N, ignore_eos=True)],
                                                chain=("target",))[0].output_ids for p in PROMPTS}


def _corrupt(seq, **fields) -> None:
    """What a bug or an unchecked edge could leave in a row's parameters (bypasses validation):
    a new parameters object, as the engine reads a row's frozen parameters once per row set."""
    params = copy.copy(seq.params)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    seq.params = params


def _run(eng: Engine, bad_after: int, corrupt) -> tuple[list, object]:
    """Greedy rows plus one sampling row in ONE batch (same chain, k, shared random stream);
    after `bad_after` steps the sampling row's state is corrupted by `corrupt(seq)`."""
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True), chain=CHAIN, k=3)
            for p in PROMPTS]
    bad = eng.add_request([3, 4, 5, 3, 4], SamplingParams(temperature=0.8, max_new_tokens=N,
                                                           ignore_eos=True), chain=CHAIN, k=3)
    steps = 0
    while eng.has_unfinished():
        if steps == bad_after:
            assert not bad.done
            corrupt(bad)
        eng.step()
        steps += 1
        assert steps < 200
    return seqs, bad


class UnplannableRow:
    """A row's plan record whose plan cannot be read (everything else reads through)."""

    def __init__(self, plan):
        self.__dict__["inner"] = plan

    def __getattr__(self, name):
        if name == "pinned":
            raise KeyError("no plan")
        return getattr(self.__dict__["inner"], name)


@pytest.mark.parametrize("how", ["top_k_overflow", "nan_temperature", "plan_raises"])
def test_a_raising_row_fails_alone(pool, solo, how):
    eng = Engine(pool, max_num_seqs=6, max_model_len=96)
    if how == "top_k_overflow":  # preparing the batch: int64 overflow building the tensors
        corrupt = lambda s: _corrupt(s, top_k=10**20)  # noqa: E731
        words = "Overflow"
    elif how == "nan_temperature":  # sampling: a NaN distribution (torch.multinomial raises)
        corrupt = lambda s: _corrupt(s, temperature=float("nan"))  # noqa: E731
        words = "RuntimeError"
    else:  # planning the row's chain raises (a bug in the row's plan record)
        corrupt = lambda s: setattr(s, "plan", UnplannableRow(s.plan))  # noqa: E731
        words = "KeyError"
    seqs, bad = _run(eng, 3, corrupt)
    for s, p in zip(seqs, PROMPTS):  # the co-batched rows: exactly their solo output
        assert s.finish_reason == "length" and s.output_ids == solo[tuple(p)], how
    assert bad.finish_reason == "error" and words in bad.error, bad.error
    assert 0 < bad.num_generated < N  # it ran, then failed, and kept what it had committed
    assert eng.running == {} and eng.state.live() == []
    # the engine serves on: a new batch runs normally
    (again,) = eng.generate_ids([PROMPTS[0]], [SamplingParams(max_new_tokens=N, ignore_eos=True)],
                                chain=CHAIN, k=3)
    assert again.output_ids == solo[tuple(PROMPTS[0])]


def test_restore_rolls_back_a_cycle_that_committed(pool, solo):
    """A failure after the cycle committed (here: the executor's step raising after its commit)
    rolls every row back to its snapshot, its request counters included; rerun alone, each row
    still produces its solo output and counts each cycle once."""
    eng = Engine(pool, max_num_seqs=6, max_model_len=96)
    calls = []
    real_step = eng.executor.step

    def step(rows, *args, **kwargs):
        result = real_step(rows, *args, **kwargs)  # commits tokens, caches and RequestStats
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("failed after the commit")
        return result

    eng.executor.step = step
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True), chain=CHAIN, k=3)
            for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    assert calls[:2] == [len(PROMPTS)] * 2
    # the failing batch was rerun one row at a time; the first row's solo rerun hit no error
    assert calls[2:2 + len(PROMPTS)] == [1] * len(PROMPTS)
    for s, p in zip(seqs, PROMPTS):
        assert s.finish_reason == "length" and s.output_ids == solo[tuple(p)]
        assert s.stats.generated == s.num_generated == N  # the rolled-back cycle is not counted


class CountingRouter(QuietRouterHooks):
    """A fixed plan; counts the router evidence of each row (one observe_step per committed
    cycle) and raises from its FIRST observation, after having recorded it (a router bug in
    the bookkeeping of a committed step)."""

    def __init__(self):
        self.cycles: dict[int, int] = {}
        self.raised = False

    def decide(self, row):
        return Decision(chain=CHAIN, k=3, t_eff=0.0, reason="fixed")

    def observe_step(self, report):
        for r in report.outcomes:
            self.cycles[r.seq_id] = self.cycles.get(r.seq_id, 0) + 1
        if not self.raised:
            self.raised = True
            raise RuntimeError("observation fails after the commit")


@pytest.mark.parametrize("where", ["router", "on_cycle"])
def test_a_failing_observation_counts_nothing_twice(pool, solo, where, caplog):
    """Observation (router evidence, the on_cycle callback) that raises after the cycle
    committed: the rows keep their tokens, run once, and count each cycle once in their
    statistics and in the router's evidence (before the fix the batch was rolled back and rerun
    row by row: statistics and evidence of the first step counted twice)."""
    router = CountingRouter()
    eng = Engine(pool, max_num_seqs=6, max_model_len=96, router=router)
    cycles_seen = []

    def on_cycle(stats):
        cycles_seen.append(stats.rows)
        if where == "on_cycle" and len(cycles_seen) == 1:
            raise RuntimeError("metrics fail after the commit")

    eng.on_cycle = on_cycle
    if where == "on_cycle":
        router.raised = True  # only on_cycle fails
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in PROMPTS]
    steps = 0
    with caplog.at_level(logging.ERROR, logger="specrouter.engine.isolation"):
        while eng.has_unfinished():
            eng.step()
            steps += 1
            assert steps < 200
    assert "evidence is lost" in caplog.text
    for s, p in zip(seqs, PROMPTS):
        assert s.finish_reason == "length" and s.output_ids == solo[tuple(p)]
        assert s.stats.generated == s.num_generated == N  # counted once
        assert s.stats.cycles == router.cycles[s.seq_id]  # one cycle of evidence per cycle run
    run = sum(s.stats.cycles for s in seqs)
    lost = len(PROMPTS)  # the failed report: its first step not (fully) reported, never rerun
    assert run - lost <= sum(cycles_seen) <= run  # no row-cycle reported twice


def test_snapshot_copies_counters_without_deepcopy(pool, monkeypatch):
    """A step's snapshot copies each row's counters (an independent copy: the row's later
    counting does not reach it, and restoring it restores them) without `copy.deepcopy`, which
    cost ~20 us a row every step of both engines; a shallow copy (the negative control) would
    share the row's dicts and lose the rollback."""
    import copy

    from specrouter.engine import isolation

    eng = Engine(pool, max_num_seqs=4, max_model_len=64)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True), chain=CHAIN, k=2)
            for p in PROMPTS]
    eng.step()
    deep = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(isolation.copy, "deepcopy", lambda *a, **kw: deep.append(1) or real_deepcopy(*a, **kw))
    snaps = isolation.snapshot(eng.state, seqs)
    assert not deep  # numbers and dicts of numbers: no deepcopy
    before = [dict(s.stats.chains) for s in seqs]
    eng.step()  # counts another cycle in place
    assert all(s.stats.chains != b for s, b in zip(seqs, before))
    assert [snap.stats.chains for snap in snaps] == before  # the snapshot did not move
    isolation.restore(eng.state, seqs, snaps)
    assert [s.stats.chains for s in seqs] == before
    shallow = copy.copy(seqs[0].stats)  # negative control: shares the dicts
    seqs[0].stats.chains["x"] = 1
    assert shallow.chains == seqs[0].stats.chains
    assert isolation.copy_stats(seqs[0].stats).chains is not seqs[0].stats.chains
