"""One OpenMP team per server process (server/threads.py, issue 34).

The mechanism (a second thread that ran torch's parallel kernels makes every barrier of the
first sleep) is shown on torch itself in a fresh process, with the fault as negative control;
then the server: every model's forwards run on the engine thread with torch's threads (with
the model timeout on: it is a watchdog, not a forward thread), and `specrouter serve` sets up
on a thread that ends."""

import os
import subprocess
import sys
import threading
import urllib.request

import openai
import pytest
import torch

from specrouter.config import ServerConfig
from specrouter.engine.faults import ForwardWatch, guard_runners
from specrouter.models.pool import Pool
from specrouter.server import create_app
from specrouter.server.live import LiveServer
from specrouter.server.threads import on_passing_thread

CPUS = len(os.sched_getaffinity(0))

# Thread `other` runs one parallel op (a team of its own, unless it gives it back) and stays
# alive; then thread `hot` runs 400 parallel ops: the voluntary context switches of the process
# during them are libgomp's barrier sleeps.
_PROBE = r"""
import os, sys, threading, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))
def sleeps():
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += int(next(l for l in f if l.startswith("voluntary_ctxt")).split()[1])
        except (OSError, StopIteration):
            pass
    return total
hold, ready, box = threading.Event(), threading.Event(), {}
def other():
    torch.ones(1 << 20).mul_(2)
    if sys.argv[1] == "released":
        from specrouter.server.threads import release_omp_team_here
        assert release_omp_team_here()
    if sys.argv[1] == "create_app":  # an in-process server set up on a thread that stays
        from specrouter.config import ServerConfig
        from specrouter.models.pool import Pool
        from specrouter.server import create_app
        pool = Pool.load([sys.argv[2]], names=["target"], target="target", dtype="float32")
        pool.runners["target"]  # loaded on this thread, then a parallel op of its own:
        torch.ones(1 << 20).mul_(2)
        box["app"] = create_app(pool, ServerConfig(max_num_seqs=1, max_model_len=32, adaptive=False))
    ready.set(); hold.wait()
def hot():
    x = torch.ones(1 << 20)
    x.mul_(1.0)
    before = sleeps()
    for _ in range(400):
        x.mul_(1.0)
    box["per_op"] = (sleeps() - before) / 400
o = threading.Thread(target=other); o.start(); ready.wait()
h = threading.Thread(target=hot); h.start(); h.join(); hold.set(); o.join()
print(box["per_op"])
"""


def _sleeps_per_op(mode: str, *args: str) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, *args], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
@pytest.mark.skipif(CPUS < 2, reason="one CPU: torch runs no parallel regions")
def test_a_second_team_makes_every_barrier_sleep_and_one_given_back_does_not(tiny_pool_dirs):
    """release_omp_team_here ends the live thread's team; create_app does it for the thread that
    loaded the pool (an in-process server): no sleeps, against >= 1 per op with the team kept."""
    two_teams = _sleeps_per_op("parallel")  # the fault: both threads opened a team
    assert two_teams >= 1.0, two_teams  # negative control: libgomp's throttled spin sleeps
    assert _sleeps_per_op("released") < 0.2
    assert _sleeps_per_op("create_app", str(tiny_pool_dirs["target"])) < 0.2


def test_on_passing_thread_returns_raises_and_ends():
    ident = {}

    def work():
        ident["thread"] = threading.current_thread()
        return 42

    assert on_passing_thread(work) == 42
    assert ident["thread"] is not threading.current_thread() and not ident["thread"].is_alive()
    with pytest.raises(KeyError, match="boom"):
        on_passing_thread(lambda: {}["boom"])


def test_guarded_runners_share_one_watch(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs[n] for n in ("draft", "target")], names=["draft", "target"],
                     target="target", dtype="float64")
    watch = ForwardWatch(5.0)
    guarded = guard_runners(pool.runners, watch)
    assert {id(r.watch) for r in guarded.values()} == {id(watch)}
    assert guard_runners(guarded, ForwardWatch(1.0)) == guarded  # wrapped ones are kept


@pytest.mark.parametrize("timeout", [30.0, None])
def test_the_engine_thread_runs_every_forward_with_torchs_threads(tiny_pool_dirs, timeout):
    """With the model timeout (the default) and without: no forward thread, no hand-off."""
    names = ("draft", "mid", "target")
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=list(names), target="target",
                     dtype="float64")
    forwards: dict[str, set] = {}
    for name, runner in pool.runners.items():
        def spy(batch, _inner=runner.forward, _name=name):
            forwards.setdefault(_name, set()).add((threading.current_thread().name, torch.get_num_threads()))
            return _inner(batch)
        runner.forward = spy
    app = create_app(pool, ServerConfig(chain=("draft", "mid", "target"), k=3, max_num_seqs=2,
                                        max_model_len=64, adaptive=False, model_timeout=timeout))
    watch = app.state.server.loop_engine.watch
    assert (watch is None) == (timeout is None)
    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)
        client.completions.create(model="target", prompt=[5, 6, 7, 8], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert urllib.request.urlopen(srv.url + "/health", timeout=10).status == 200
        if watch is not None:
            assert watch._thread is not None and watch._thread.is_alive()  # the watchdog runs
    assert set(forwards) == set(names)
    assert set().union(*forwards.values()) == {("specrouter-engine", torch.get_num_threads())}
    assert watch is None or watch._thread is None  # stopped with the server


def test_the_engine_thread_hands_each_steps_tokens_over_before_the_next_step(tiny_pool_dirs):
    """`AsyncEngine._deliver` waits until the event loop has taken a step's tokens and run the
    task they woke: the loop's per-step work never overlaps a forward (a long `handoff_wait`
    here, so that a slow machine cannot make the test flaky). The control: with no wait and a
    task that takes its tokens 50 ms late, the engine steps on without it (nothing else orders
    the two threads; without the lag the race is decided by timing, and the control was flaky)."""
    import asyncio

    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.server.async_engine import AsyncEngine

    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target", dtype="float64")
    eng = Engine(pool, max_num_seqs=2, max_model_len=64)
    log: list[tuple[str, int]] = []
    step = eng.step

    def logged_step():
        log.append(("step", 0))
        return step()

    eng.step = logged_step

    async def run(wait: float, lag: float = 0.0) -> None:
        ae = AsyncEngine(eng, seed=0, handoff_wait=wait)
        ae.start()
        try:
            h = ae.submit([5, 6, 7], SamplingParams(max_new_tokens=12, ignore_eos=True), chain=("target",), k=1)
            done = False
            while not done:
                ev = await h.events.get()  # directly, as the server's handlers (no task between)
                if lag:
                    await asyncio.sleep(lag)
                log.append(("took", len(ev.token_ids)))
                done = ev.done
        finally:
            await asyncio.to_thread(ae.stop)

    asyncio.run(run(30.0))
    kinds = [k for k, _ in log]
    assert kinds.count("step") == 12 and kinds == ["step", "took"] * 12, log
    log.clear()
    asyncio.run(run(0.0, lag=0.05))
    kinds = [k for k, _ in log]
    assert kinds.count("step") == 12 and kinds != ["step", "took"] * 12, log


# `specrouter serve`'s default threads on a machine of k CPUs, faked by the affinity mask set before
# torch is imported (torch's default intra-op threads, libgomp's CPU count: the CPUs it may use)
_CORES = r"""
import os, sys, threading
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(sys.argv[1])]))
import openai, torch
from specrouter.config import ServerConfig
from specrouter.models.pool import Pool
from specrouter.server import create_app
from specrouter.server.live import LiveServer
from specrouter.server.threads import on_passing_thread
ran = set()
def setup():
    pool = Pool.load([sys.argv[2]], names=["target"], target="target", dtype="float64")
    for r in pool.runners.values():
        def spy(batch, _inner=r.forward):
            ran.add((threading.current_thread().name, torch.get_num_threads()))
            return _inner(batch)
        r.forward = spy
    return create_app(pool, ServerConfig(max_num_seqs=2, max_model_len=64, adaptive=False))
app = on_passing_thread(setup)
with LiveServer(app) as srv:
    openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60).completions.create(
        model="target", prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
print(len(os.sched_getaffinity(0)), sorted(ran))
"""


@pytest.mark.parametrize("cores", sorted({1, 2, CPUS} & set(range(1, CPUS + 1))))
def test_default_threads_one_team_as_wide_as_the_cores_on_any_core_count(tiny_pool_dirs, cores):
    """The default flags on a machine of `cores` CPUs (faked: the affinity mask of a fresh
    process; on a many-core machine this runs at its full count too): the set-up on a thread
    that ends (as `specrouter serve`), then every forward on the engine thread with torch's
    default threads, which are the CPUs: ONE team of as many threads as cores, so libgomp's
    throttle (managed threads > CPUs: server/threads.py) never holds, for any core count."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _CORES, str(cores), str(tiny_pool_dirs["target"])],
                         capture_output=True, text=True, env=env, timeout=180, check=True)
    got = out.stdout.strip().splitlines()[-1]
    assert got == f"{cores} {[('specrouter-engine', cores)]}", out.stderr[-2000:]
