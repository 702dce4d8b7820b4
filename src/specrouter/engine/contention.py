"""A thread's torch threads when another process takes a core (`TeamGovernor`).

A forward of the native runner is one OpenMP parallel region whose threads meet at a barrier
after every phase (about 180 barriers a forward of the 135M target), and libgomp's threads spin
at a barrier. When another process runs on one of the cores the team counts on (a compile in
another session: Linux's autogroups give every session an equal share of the CPU, whatever its
nice value), the team's threads share the cores that are left, and at every barrier one thread
spins through its time slice while the other waits to run. Measured on a 2-core Zen 1 (avx2
kernels) beside one such compile: the server's 2-row steps took 206 ms instead of 24, 8.9 tok/s
against 72.7 in the same run once the compile had ended (docs/serving-performance.md, "Stalls
under a co-tenant"). One thread on the core that is left runs a step at one thread's speed.

`TeamGovernor` watches the thread that runs the forwards: the server's engine thread
(server/threads.py, AsyncEngine) and, in the library, the caller's thread in the offline loops
(`Engine.generate_ids`, `SpecRouter.stream`) through `governed`, with that thread's own governor
(`thread_governor`); the count it sets holds inside those loops only. On the 2-core Zen 5 VM of
session 23 one busy process in another session made the library's forwards of the 135M target
750-1000 ms (~100-200x), target-only and SpecRouter alike (1.2-4.5 tok/s, 190-230 quiet); on
one thread beside it 134 tok/s (docs/router.md, "Stalls are a co-tenant's", stall23). Per step
it reads the thread's CPU seconds (`time.thread_time`, spinning included) against the step's
wall seconds: a team that has its cores runs the whole step, a starved one a fraction of it.
When over `window` seconds of steps the share falls below `starved`, the thread runs on as many
torch threads as it had cores (threads x share, at least one: one on 2 cores). While reduced it
reads the machine's idle CPU (`/proc/stat`) every `recheck` seconds and goes back to its own
count when the cores it gave up were idle since the last read (`free_cores` of each on average:
the co-tenant has gone); a co-tenant that comes back at once doubles the wait before the next try.
The server's engine, starting a batch after a pause, reads the idle CPU of the pause first (`wake`): back at
once if the cores were free, else a fresh count over the batch's own steps. The native kernels' bits do
not depend on the thread count (each output on one thread; tests/test_rowinv_kernels.py), so
outputs do not change; a pool with a model on torch's kernels (the transformers fallback, or a
linear the native blocks do not divide), whose GEMMs may split work by thread count, is never
governed (`ModelRunner.thread_invariant`, `Engine.thread_invariant`; review23 N9).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

STARVED = 0.7  # the stepping thread ran less than this share of its steps' wall time: cores taken
WINDOW_S = 0.5  # seconds of steps weighed at a time
RECHECK_S = 1.0  # seconds between idle-CPU reads while on one thread
FRESH_S = 0.25  # seconds to the first idle read of a batch that starts reduced (`TeamGovernor.wake`)
FREE_CORES = 0.5  # idle share of each core given up (since the last read) that means the co-tenant has gone
MAX_BACKOFF = 16  # a drop soon after a restore doubles the wait before the next try, up to 16 x recheck


def idle_cores_reader(path: str = "/proc/stat", clock: Callable[[], float] = time.monotonic
                      ) -> Callable[[], float | None] | None:
    """A function returning the machine's idle cores on average since its last call (None on its
    first call), from the kernel's CPU counters; None where they cannot be read (not Linux)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read() -> float | None:
        with open(path) as f:
            fields = f.readline().split()  # "cpu user nice system idle iowait ..." in clock ticks
        return (int(fields[4]) + int(fields[5])) / hz

    try:
        read()
    except (OSError, ValueError, IndexError):
        return None
    last: list[tuple[float, float]] = []

    def idle_cores() -> float | None:
        now, idle = clock(), read()
        prev = last[0] if last else None
        last[:] = [(now, idle)]
        if prev is None or now <= prev[0]:
            return None
        return (idle - prev[1]) / (now - prev[0])

    return idle_cores


class TeamGovernor:
    """The stepping thread's torch threads (the server's engine thread, a library caller's):
    fewer while other processes take the team's cores, its own count otherwise (module
    docstring). `observe` is called by that thread after every step; `set_threads`
    (torch.set_num_threads) then acts on that thread's parallel regions."""

    def __init__(self, *, starved: float = STARVED, window: float = WINDOW_S, recheck: float = RECHECK_S,
                 fresh: float = FRESH_S, free_cores: float = FREE_CORES, idle_cores: Callable[[], float | None] | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, int], None] | None = None):
        self.starved, self.window, self.recheck, self.free_cores = starved, window, recheck, free_cores
        self.fresh = fresh  # seconds to the first idle read after a wake that did not restore
        self.on_change = on_change  # ("drop" | "restore", the count it set), e.g. ServerMetrics.observe_governor
        self.idle_cores = idle_cores if idle_cores is not None else idle_cores_reader()
        self.set_threads, self.get_threads, self.clock = set_threads, get_threads, clock
        self.threads: int | None = None  # the thread's own count (read at its first step)
        self.current = 0  # its count now
        self.wall = self.cpu = 0.0  # the window's sums
        self.next_check = 0.0  # clock time of the next idle read (while reduced)
        self.drops = self.restores = 0  # times it reduced its threads / went back to its own count
        self.backoff = recheck  # seconds before the first idle read after a drop
        self.restored_at: float | None = None  # clock time of the last restore

    def observe(self, wall: float, cpu: float) -> None:
        """A step of `wall` seconds during which the stepping thread ran `cpu` seconds."""
        if self.threads is None:
            self.threads = self.current = self.get_threads()
        if self.idle_cores is None or self.threads <= 1:
            return  # nothing to reduce, or no way to see the co-tenant leave
        if self.current < self.threads:  # reduced: back when the cores it gave up are idle
            now = self.clock()
            if now >= self.next_check:
                self.next_check = now + self.recheck
                self._read_idle(now)
            return
        self.wall += wall
        self.cpu += cpu
        if self.wall < self.window:
            return
        share = self.cpu / self.wall
        self.wall = self.cpu = 0.0
        if share < self.starved:  # the cores the team had: about threads * share of them
            self._set(max(1, min(self.threads - 1, int(self.threads * share))))
            self.drops += 1
            if self.on_change is not None:
                self.on_change("drop", self.current)
            now = self.clock()
            soon = self.restored_at is not None and now - self.restored_at < 4 * self.window
            self.backoff = min(2 * self.backoff, MAX_BACKOFF * self.recheck) if soon else self.recheck
            self.idle_cores()  # the idle count starts now
            self.next_check = now + self.backoff

    def enter(self) -> None:
        """An offline loop on this thread starts (`governed`). The thread's count now is the
        caller's (`leave` put it back): the team's own count the first time, or when the caller
        set another since (torch.set_num_threads: that count is its own now, not reduced);
        while reduced the loop runs on the reduced count again (the idle reads of `observe`
        bring it back once the cores are free)."""
        n = self.get_threads()
        if self.threads is None or n != self.threads:
            self.threads = self.current = n
            self.wall = self.cpu = 0.0
        elif self.current < self.threads:
            self.set_threads(self.current)

    def leave(self) -> None:
        """The offline loop ends: the caller's thread runs on the team's own count outside it
        (a profile's machine fingerprint, the caller's own torch work); the governor stays
        reduced for the next loop."""
        if self.threads is not None and self.current < self.threads:
            self.set_threads(self.threads)

    def wake(self) -> None:
        """The engine starts stepping after it was idle (no rows; AsyncEngine, engine thread). While
        reduced: the idle count since the last read covers the pause, when no step of this engine
        ran. Idle enough, the cores it gave up were free then: back to its own count before the
        first step (a batch's prefill is its longest step). Not, something else ran meanwhile
        (the co-tenant, or the pause was short): the count restarts now and the next read comes
        `fresh` seconds on, so that it weighs this batch's steps only; without the restart the
        first read after the batch's first step averaged the pause in, and the team stayed on
        one thread for another `recheck` (a c=8 level ran 55% of its step seconds on one thread,
        docs/serving-performance.md, twelfth round)."""
        if self.threads is None or self.idle_cores is None or self.current >= self.threads:
            return
        now = self.clock()
        if not self._read_idle(now):
            self.next_check = now + self.fresh

    def _read_idle(self, now: float) -> bool:
        """Read the idle cores since the last read; back to the team's own count if the cores it
        gave up were idle (True)."""
        idle = self.idle_cores()
        if idle is None or idle < self.free_cores * (self.threads - self.current):
            return False
        self._set(self.threads)
        self.restores += 1
        self.restored_at = now
        if self.on_change is not None:
            self.on_change("restore", self.current)
        return True

    def reset(self) -> None:
        """A new engine thread (after a hang, server/async_engine.py), on this thread: it runs on
        the team's own count again (a count the old thread reduced may be torch's global one), and
        the window starts afresh."""
        if self.threads is not None and self.current != self.threads:
            self._set(self.threads)
        self.wall = self.cpu = 0.0

    def _set(self, n: int) -> None:
        self.set_threads(n)
        self.current, self.wall, self.cpu = n, 0.0, 0.0


_threads = threading.local()  # each thread's TeamGovernor (`thread_governor`)
T = TypeVar("T")


def thread_governor() -> TeamGovernor:
    """The calling thread's governor, made on its first call: torch's thread count is a
    per-thread setting (OpenMP's nthreads ICV), so the engines and routers a thread runs in turns
    share one (one per engine would each read the count another had reduced as its own)."""
    gov = getattr(_threads, "governor", None)
    if gov is None:
        gov = _threads.governor = TeamGovernor()
    return gov


@contextlib.contextmanager
def governed(governor: TeamGovernor | None = None, *, enabled: bool = True
             ) -> Iterator[Callable[[Callable[[], T]], T]]:
    """An offline loop's steps on the calling thread, governed: yields `timed`, which runs a step
    and tells the governor (default: `thread_governor()`) its wall and this thread's CPU seconds.
    The count the governor set holds inside the block; outside it the thread runs on its own.
    `enabled=False` (a model whose bits may depend on the thread count: `Engine.thread_invariant`):
    the steps run on the thread's own count, ungoverned."""
    if not enabled:
        yield lambda step: step()
        return
    gov = thread_governor() if governor is None else governor
    gov.enter()

    def timed(step: Callable[[], T]) -> T:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        out = step()
        gov.observe(time.perf_counter() - t0, time.thread_time() - cpu0)
        return out

    try:
        yield timed
    finally:
        gov.leave()
