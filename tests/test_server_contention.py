"""The engine thread's torch threads under CPU contention (engine/contention.py,
docs/serving-performance.md "Stalls under a co-tenant"): a team whose cores another process
takes runs on fewer threads, and on its own count again once the cores it gave up are idle; the
engine thread's forwards run on the count the governor set, and the outputs do not change.
No wall clock: the governor is fed scripted step shares and idle readings."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from specrouter.bench.serve_steps import ThreadSteps
from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.server.async_engine import AsyncEngine
from specrouter.engine.contention import TeamGovernor, idle_cores_reader
from specrouter.server.metrics import ServerMetrics


class Script:
    """A governor's world: its clock, idle readings and the thread counts it set."""

    def __init__(self, threads: int = 2):
        self.now, self.idle, self.set, self.threads = 0.0, 0.0, [], threads

    def governor(self, **kw) -> TeamGovernor:
        def set_threads(n):
            self.set.append(n)

        return TeamGovernor(idle_cores=lambda: self.idle, set_threads=set_threads, get_threads=lambda: self.threads,
                            clock=lambda: self.now, **kw)

    def steps(self, gov: TeamGovernor, n: int, share: float, wall: float = 0.025) -> None:
        for _ in range(n):
            self.now += wall
            gov.observe(wall, wall * share)


def test_a_starved_team_drops_to_one_thread_and_a_team_with_its_cores_never_does():
    w = Script()
    gov = w.governor()
    w.steps(gov, 400, 0.97)  # the engine thread ran its whole steps: its cores are its own
    assert w.set == [] and gov.current == 2  # the negative control: never reduced
    w.steps(gov, 19, 0.5)  # 0.475 s of steps at half a share: the window is not full yet
    assert w.set == []
    w.steps(gov, 2, 0.5)  # ... now it is: 2 threads that had one core between them
    assert w.set == [1] and gov.current == 1 and gov.drops == 1


def test_it_goes_back_once_the_core_it_gave_up_is_idle():
    w = Script()
    gov = w.governor()
    w.steps(gov, 40, 0.5)
    assert w.set == [1]
    w.idle = 0.05  # the co-tenant still runs: the other core is busy
    w.steps(gov, 200, 1.0)
    assert w.set == [1]
    w.idle = 0.95  # it has gone
    w.steps(gov, 50, 1.0)
    assert w.set == [1, 2] and gov.current == 2 and gov.restores == 1


def test_a_new_engine_thread_after_a_hang_runs_on_the_teams_own_count():
    w = Script()
    gov = w.governor()
    gov.reset()  # a first thread replaced before any step: nothing known, nothing set
    assert w.set == []
    w.steps(gov, 40, 0.5)
    assert w.set == [1]
    gov.reset()  # the old thread hung while reduced: its replacement gets the team's count back
    assert w.set == [1, 2] and gov.current == 2 and gov.threads == 2
    w.steps(gov, 400, 0.97)  # and, with its cores, keeps it
    assert w.set == [1, 2]


def test_a_co_tenant_back_at_once_doubles_the_wait_before_the_next_try():
    w = Script()
    gov = w.governor(recheck=1.0, window=0.5)
    w.steps(gov, 40, 0.5)
    assert gov.backoff == 1.0
    w.idle = 0.95
    w.steps(gov, 50, 1.0)  # restored
    w.steps(gov, 40, 0.5)  # and starved again within 4 windows
    assert w.set == [1, 2, 1] and gov.backoff == 2.0
    w.steps(gov, 100, 1.0)  # restored again, then the machine is its own for a while
    w.steps(gov, 400, 0.97)
    w.steps(gov, 40, 0.5)
    assert w.set == [1, 2, 1, 2, 1] and gov.backoff == 1.0


class Machine:
    """Idle CPU as the kernel counts it: idle core-seconds accumulate at `rate` cores while the
    clock runs; a read returns the average since the previous read (as `idle_cores_reader`)."""

    def __init__(self):
        self.now, self.total, self.rate, self.last, self.set, self.reads = 0.0, 0.0, 0.0, None, [], 0

    def passes(self, seconds: float) -> None:
        self.now += seconds
        self.total += self.rate * seconds

    def idle_cores(self) -> float | None:
        self.reads += 1
        prev, self.last = self.last, (self.now, self.total)
        if prev is None or self.now <= prev[0]:
            return None
        return (self.total - prev[1]) / (self.now - prev[0])

    def governor(self) -> TeamGovernor:
        return TeamGovernor(idle_cores=self.idle_cores, set_threads=self.set.append, get_threads=lambda: 2,
                            clock=lambda: self.now)

    def step(self, gov: TeamGovernor, wall: float, share: float) -> None:
        self.passes(wall)
        gov.observe(wall, wall * share)


def _dropped_then_paused(m: Machine, pause_idle: float) -> TeamGovernor:
    """A co-tenant starves the team (dropped to one thread); the engine then pauses 5 s between
    batches while the machine idles at `pause_idle` cores."""
    gov = m.governor()
    for _ in range(40):
        m.step(gov, 0.025, 0.5)
    assert m.set == [1]
    for _ in range(20):  # the co-tenant is still there: nothing idle, it stays on one thread
        m.step(gov, 0.025, 1.0)
    m.rate = pause_idle
    m.passes(5.0)
    return gov


def test_a_batch_after_a_pause_weighs_the_pause_then_only_its_own_steps():
    """The bench's case (twelfth round): the co-tenant left while another process ran (the pause
    was busy), then a batch starts; its first step (a prefill, 1.5 s) runs beside an idle core.
    With `wake` the count restarts at the batch's start: back on two threads after that step.
    The negative control, no `wake`: the first read averages the busy pause in (0.22 cores), and
    the team stays on one thread until the next read a second later."""
    for woken in (True, False):
        m = Machine()
        gov = _dropped_then_paused(m, pause_idle=0.0)
        if woken:
            gov.wake()
            assert m.set == [1]  # the pause was busy: still one thread
        m.rate = 0.95  # the co-tenant has gone: the core it took idles
        m.step(gov, 1.5, 1.0)
        assert m.set == ([1, 2] if woken else [1]), woken
        for _ in range(40):
            m.step(gov, 0.025, 1.0)
        assert m.set == [1, 2] and gov.restores == 1  # the control gets there a second later


def test_a_batch_after_an_idle_pause_starts_on_its_own_count():
    m = Machine()
    gov = _dropped_then_paused(m, pause_idle=1.9)  # nothing ran in the pause: the co-tenant has gone
    gov.wake()
    assert m.set == [1, 2] and gov.current == 2  # before the batch's first step
    reads = m.reads
    gov.wake()  # on its own count: a wake reads nothing
    assert m.reads == reads and m.set == [1, 2]


def test_many_threads_keep_as_many_as_the_cores_they_had():
    w = Script(threads=8)
    gov = w.governor()
    w.steps(gov, 40, 0.55)  # 8 threads on ~4.4 cores
    assert w.set == [4]
    w.idle = 1.5  # one and a half cores idle: not the four it gave up
    w.steps(gov, 200, 1.0)
    assert w.set == [4]
    w.idle = 3.6
    w.steps(gov, 50, 1.0)
    assert w.set == [4, 8]


def test_one_thread_or_no_idle_counter_leaves_the_threads_alone():
    w = Script(threads=1)
    gov = w.governor()
    w.steps(gov, 100, 0.3)
    assert w.set == []
    w = Script()
    gov = TeamGovernor(idle_cores=None, set_threads=w.set.append, get_threads=lambda: 2)
    gov.idle_cores = None  # a machine whose idle CPU cannot be read: it could never go back
    w.steps(gov, 100, 0.3)
    assert w.set == []


def test_idle_cores_from_the_kernels_counters(tmp_path):
    import os

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(f"cpu  100 0 50 {10 * hz} {2 * hz} 0 0 0 0 0\ncpu0 1 2 3\n")
    now = [0.0]
    read = idle_cores_reader(str(stat), clock=lambda: now[0])
    assert read() is None  # the first call starts the count
    now[0] = 2.0
    stat.write_text(f"cpu  300 0 90 {11 * hz} {int(2.5 * hz)} 0 0 0 0 0\n")  # 1.5 s idle + iowait in 2 s
    assert read() == pytest.approx(0.75)
    assert idle_cores_reader(str(tmp_path / "absent")) is None


def record_threads(runner) -> list[int]:
    """The torch thread count each forward of `runner` runs on, appended as the forwards run."""
    seen: list[int] = []
    forward = runner.forward

    def spy(batch):
        seen.append(torch.get_num_threads())
        return forward(batch)

    runner.forward = spy
    return seen


def test_the_engine_threads_forwards_run_on_the_count_the_governor_set(tiny_pool_dirs):
    """Through the AsyncEngine: the governor reduces after the first step and restores after the
    third; the target's forwards see 2, then 1, then 2 torch threads on the engine thread, and
    the greedy tokens equal those of the same request with the governor never acting."""
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    seen = record_threads(pool.runners["target"])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    class Pausing(threading.Condition):
        """The engine's condition, telling when its thread first waits for work."""

        def __init__(self):
            super().__init__()
            self.paused = threading.Event()

        def wait(self, timeout=None):
            self.paused.set()
            return super().wait(timeout)

    def serve(governor: TeamGovernor, metrics: ServerMetrics | None = None) -> list[int]:
        engine = Engine(pool, max_num_seqs=2, max_model_len=64)

        async def main():
            ae = AsyncEngine(engine, seed=0, governor=governor, metrics=metrics)
            ae._cv = Pausing()  # the request arrives while the engine thread waits (its pause)
            ae.start()
            try:
                await asyncio.to_thread(ae._cv.paused.wait, 30)
                h = ae.submit([5, 6, 7], params, chain=("target",), k=1)
                tokens = []
                while True:
                    ev = await h.events.get()
                    tokens += ev.token_ids
                    if ev.done:
                        return tokens
            finally:
                await asyncio.to_thread(ae.stop)

        return asyncio.run(main())

    steps, wakes = [0], [0]
    idle = [0.0]

    def set_threads(n: int) -> None:  # on the engine thread, as torch.set_num_threads would be
        torch.set_num_threads(n)

    class Scripted(TeamGovernor):
        """Step 1 starved, later steps run whole (the machine's real shares would make the
        test depend on its load); idle from step 3 on."""

        def __init__(self, starve: bool, **kw):
            super().__init__(**kw)
            self.starve = starve

        def wake(self):
            wakes[0] += 1
            super().wake()

        def observe(self, wall, cpu):
            steps[0] += 1
            idle[0] = 1.0 if steps[0] >= 3 else 0.0
            super().observe(wall, 0.3 * wall if self.starve and steps[0] == 1 else wall)

    metrics = ServerMetrics()
    gov = Scripted(True, window=0.0, recheck=0.0, idle_cores=lambda: idle[0], set_threads=set_threads,
                   get_threads=lambda: 2, on_change=metrics.observe_governor)
    torch_threads = torch.get_num_threads()
    try:
        tokens = serve(gov, metrics)
    finally:
        torch.set_num_threads(torch_threads)
    assert gov.drops == 1 and gov.restores == 1
    assert wakes[0] >= 1  # the engine thread woke from its pause for the request (AsyncEngine._run)
    assert seen[1:3] == [1, 1] and seen[3] == 2, seen
    # /metrics: the steps by the threads they ran on (a forward a step: as the forwards saw them),
    # the drop and the restore
    counted = ThreadSteps.parse(metrics.render().decode())
    assert counted.changes == {"drop": 1.0, "restore": 1.0}
    assert {n: v[0] for n, v in counted.steps.items()} == {n: seen.count(n) for n in set(seen)}, (counted.steps, seen)
    assert all(v[1] > 0 and v[2] >= 0 for v in counted.steps.values())
    seen.clear()
    acted = []
    control = serve(Scripted(False, window=0.0, recheck=0.0, idle_cores=lambda: idle[0], set_threads=acted.append,
                             get_threads=lambda: 2))
    assert control == tokens and acted == [] and len(set(seen)) == 1  # never reduced: one count


def test_the_server_config_turns_the_governor_on_and_off(tiny_pool_dirs):
    """ServerConfig.team_governor (serve --no-team-governor): on, the server's engine thread has a
    governor that reports its changes to /metrics; off, none (its torch threads never change).
    A pool on torch's kernels (float64 here) gets none either way: its bits may move with the
    thread count (Engine.thread_invariant, review23 N9)."""
    from specrouter.server import ServerConfig, create_app

    for dtype, on in (("float32", True), ("float32", False), ("float64", True)):
        pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype=dtype)
        srv = create_app(pool, ServerConfig(max_num_seqs=1, max_model_len=32, adaptive=False,
                                            team_governor=on)).state.server
        gov = srv.loop_engine.governor
        if on and dtype == "float32":
            assert isinstance(gov, TeamGovernor) and gov.on_change == srv.metrics.observe_governor
        else:
            assert gov is None
        srv.close()
