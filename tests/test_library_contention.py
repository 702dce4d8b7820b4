"""The library's offline loops under CPU contention (engine/contention.py `governed`,
docs/router.md "Stalls are a co-tenant's"): `Engine.generate_ids` and `SpecRouter.stream` run
their steps on the calling thread's governor, so a team whose cores another process takes runs
on fewer torch threads (on this session's Zen 5 VM a 2-thread team beside one busy process ran
its forwards ~100-200x slower, one thread ~1.5x); outside the loops the thread keeps the
caller's count. No wall clock: the governors are fed scripted step shares and idle readings."""

from __future__ import annotations

import threading

import pytest
import torch
from test_server_contention import record_threads

from specrouter.api import SpecRouter
from specrouter.config import SamplingParams
from specrouter.engine import contention
from specrouter.engine.contention import TeamGovernor, governed, thread_governor
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool


class Scripted(TeamGovernor):
    """The thread's governor: step 1 starved (30% of its wall on the CPU), later steps whole;
    the other core idle from step 3 on. `starve=False`: the negative control, never starved."""

    def __init__(self, starve: bool):
        self.idle, self.steps = 0.0, 0
        super().__init__(window=0.0, recheck=0.0, idle_cores=lambda: self.idle)
        self.starve = starve

    def observe(self, wall, cpu):
        self.steps += 1
        self.idle = 1.0 if self.steps >= 3 else 0.0
        super().observe(wall, 0.3 * wall if self.starve and self.steps == 1 else wall)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("loop", ["generate_ids", "stream"])
def test_the_offline_loops_forwards_run_on_the_count_the_governor_set(tiny_pool_dirs, two_threads, monkeypatch, loop):
    """The thread's governor drops after the first step and restores after the third: the
    target's forwards see 2, then 1, then 2 torch threads; after the loop the caller's thread is
    on its own count; the greedy tokens equal those of a run whose governor never acts, which
    runs every forward on 2 (the negative control). Without `governed` in the loop every
    forward runs on 2 and the test fails."""
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float32")
    seen = record_threads(pool.runners["target"])

    def run(gov: TeamGovernor) -> list[int]:
        monkeypatch.setattr(contention._threads, "governor", gov, raising=False)  # this thread's
        seen.clear()
        if loop == "generate_ids":
            params = SamplingParams(max_new_tokens=6, ignore_eos=True)
            return Engine(pool).generate_ids([[5, 6, 7]], [params], chain=("target",), k=1)[0].output_ids
        sr = SpecRouter(pool.with_fresh_drafters())
        return [t for c in sr.stream([5, 6, 7], max_new_tokens=6, ignore_eos=True, chain=["target"], k=1)
                for t in c.token_ids]

    gov = Scripted(True)
    tokens = run(gov)
    assert gov.drops == 1 and gov.restores == 1
    assert seen[0] == 2 and seen[1:3] == [1, 1] and set(seen[3:]) == {2}, seen
    assert torch.get_num_threads() == 2  # the caller's own count outside the loop
    control = Scripted(False)
    assert run(control) == tokens and len(tokens) == 6
    assert control.drops == 0 and set(seen) == {2}


def test_outside_a_loop_the_thread_keeps_the_callers_count_and_the_next_loop_runs_reduced():
    """`leave` puts the caller's count back and `enter` the reduced one; a count the caller set
    between loops is the team's own from then on (not reduced)."""
    actual = [2]
    gov = TeamGovernor(window=0.0, recheck=100.0, idle_cores=lambda: 0.0, clock=lambda: 0.0,
                       set_threads=lambda n: actual.__setitem__(0, n), get_threads=lambda: actual[0])
    with governed(gov):
        gov.observe(0.1, 0.1)  # a step, whole: a team with its cores
        assert actual == [2] and gov.current == 2
        gov.observe(0.1, 0.03)  # starved
        assert actual == [1] and gov.current == 1
    assert actual == [2] and gov.current == 1  # outside: the caller's; the governor stays reduced
    with governed(gov):
        assert actual == [1]  # the next loop runs reduced at once
    assert actual == [2]
    actual[0] = 4  # the caller's torch.set_num_threads(4) between loops
    with governed(gov):
        assert actual == [4] and gov.threads == 4 and gov.current == 4  # its own count now
    assert actual == [4]


def test_each_thread_has_its_own_governor():
    """torch's thread count is per thread: one governor per thread, the same one for every
    engine a thread runs."""
    mine = thread_governor()
    assert thread_governor() is mine
    other = []
    t = threading.Thread(target=lambda: other.append(thread_governor()))
    t.start()
    t.join()
    assert isinstance(other[0], TeamGovernor) and other[0] is not mine


def test_a_pool_on_torchs_kernels_is_never_governed(tiny_pool_dirs, two_threads, monkeypatch):
    """A model on torch's kernels (float64 here; the transformers fallback alike) may split a GEMM
    by thread count, so its bits could move with the count: its loops keep the caller's threads
    however starved the steps read (review23 N9). The same checkpoint on the native kernels
    (float32) is thread-invariant and governed (the test above)."""
    f32 = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float32")
    f64 = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    assert Engine(f32).thread_invariant and not Engine(f64).thread_invariant
    gov = Scripted(True)
    monkeypatch.setattr(contention._threads, "governor", gov, raising=False)
    seen = record_threads(f64.runners["target"])
    Engine(f64).generate_ids([[5, 6, 7]], [SamplingParams(max_new_tokens=6, ignore_eos=True)],
                             chain=("target",), k=1)
    assert gov.steps == 0 and gov.drops == 0 and set(seen) == {2}, (gov.steps, seen)
