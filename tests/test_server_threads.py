"""One OpenMP team per server process (server/threads.py, issue 34).

The mechanism (a second thread that ran torch's parallel kernels makes every barrier of the
first sleep) is shown on torch itself in a fresh process, with the fault as negative control;
then the server: every model's forwards run on one forward thread, the engine thread's torch
work is serial, and `specrouter serve` sets up on a thread that ends."""

import os
import subprocess
import sys
import threading
import urllib.request

import openai
import pytest
import torch

from specrouter.config import ServerConfig
from specrouter.engine.faults import ForwardThread, GuardedRunner, guard_runners
from specrouter.models.pool import Pool
from specrouter.server import create_app
from specrouter.server.live import LiveServer
from specrouter.server.threads import on_passing_thread, serial_torch_here

CPUS = len(os.sched_getaffinity(0))

# Thread `other` runs one parallel op (a team of its own, unless made serial first) and stays
# alive; then thread `hot` runs 400 parallel ops: the voluntary context switches of the process
# during them are libgomp's barrier sleeps.
_PROBE = r"""
import os, sys, threading, torch
from specrouter.server.threads import serial_torch_here
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
    if sys.argv[1] == "serial":
        serial_torch_here()
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


@pytest.mark.skipif(CPUS < 2, reason="one CPU: torch runs no parallel regions")
def test_a_second_team_makes_every_barrier_sleep_and_a_serial_thread_does_not():
    two_teams = _sleeps_per_op("parallel")  # the fault: both threads opened a team
    one_team = _sleeps_per_op("serial")  # the fix: the other thread's torch work is serial
    assert two_teams >= 1.0, two_teams  # negative control: libgomp's throttled spin sleeps
    assert one_team < 0.2, one_team


@pytest.mark.skipif(CPUS < 2, reason="one CPU: torch runs no parallel regions")
def test_a_thread_that_stays_gives_its_team_back(tiny_pool_dirs):
    """release_omp_team_here ends the live thread's team; create_app does it for the thread that
    loaded the pool (an in-process server): no sleeps. The negative control is the first test's
    'parallel' probe (the same live thread with its team kept)."""
    assert _sleeps_per_op("released") < 0.2
    assert _sleeps_per_op("create_app", str(tiny_pool_dirs["target"])) < 0.2


def test_serial_torch_here_is_per_thread():
    n = torch.get_num_threads()
    seen = {}

    def serial():
        seen["ok"] = serial_torch_here()
        seen["serial"] = torch.get_num_threads()

    def other():
        seen["other"] = torch.get_num_threads()

    for fn in (serial, other):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    assert seen == {"ok": True, "serial": 1, "other": n}
    assert torch.get_num_threads() == n


def test_on_passing_thread_returns_raises_and_ends():
    ident = {}

    def work():
        ident["thread"] = threading.current_thread()
        return 42

    assert on_passing_thread(work) == 42
    assert ident["thread"] is not threading.current_thread() and not ident["thread"].is_alive()
    with pytest.raises(KeyError, match="boom"):
        on_passing_thread(lambda: {}["boom"])


def test_guarded_runners_share_one_forward_thread(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs[n] for n in ("draft", "target")], names=["draft", "target"],
                     target="target", dtype="float64")
    guarded = guard_runners(pool.runners, 5.0)
    assert len({id(r.thread) for r in guarded.values()}) == 1  # one OpenMP team for all models
    alone = GuardedRunner(pool.runners["draft"], 5.0)
    assert alone.thread is not guarded["draft"].thread
    assert isinstance(alone.thread, ForwardThread)


def test_server_runs_every_forward_on_one_thread_and_the_engine_thread_serial(tiny_pool_dirs):
    names = ("draft", "mid", "target")
    pool = Pool.load([tiny_pool_dirs[n] for n in names], names=list(names), target="target",
                     dtype="float64")
    forwards: dict[str, set[str]] = {}
    for name, runner in pool.runners.items():
        def spy(batch, _inner=runner.forward, _name=name):
            forwards.setdefault(_name, set()).add(threading.current_thread().name)
            return _inner(batch)
        runner.forward = spy
    app = create_app(pool, ServerConfig(chain=("draft", "mid", "target"), k=3, max_num_seqs=2,
                                        max_model_len=64, adaptive=False))
    engine = app.state.server.engine
    cycles = []
    observe = engine.on_cycle

    def watch(*args, **kw):
        cycles.append((threading.current_thread().name, torch.get_num_threads()))
        return observe(*args, **kw)

    engine.on_cycle = watch
    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)
        client.completions.create(model="target", prompt=[5, 6, 7, 8], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert urllib.request.urlopen(srv.url + "/health", timeout=10).status == 200
    for r in app.state.server.pool.runners.values():
        r.close()
    assert set(forwards) == set(names)
    assert set().union(*forwards.values()) == {"specrouter-forward"}
    assert cycles and set(cycles) == {("specrouter-engine", 1)}


def test_without_a_timeout_the_engine_thread_runs_the_forwards_in_parallel(tiny_pool_dirs):
    pool = Pool.load([tiny_pool_dirs["target"]], names=["target"], target="target",
                     dtype="float64")
    seen = set()
    inner = pool.runners["target"].forward

    def spy(batch):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return inner(batch)

    pool.runners["target"].forward = spy
    app = create_app(pool, ServerConfig(max_num_seqs=1, max_model_len=32, model_timeout=None,
                                        adaptive=False))
    with LiveServer(app) as srv:
        openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0).completions.create(
            model="target", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert seen == {("specrouter-engine", torch.get_num_threads())}
