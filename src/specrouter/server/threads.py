"""One OpenMP team per server process: which threads may run torch's parallel kernels.

torch's CPU kernels (and SpecRouter's native ones) run their parallel regions on OpenMP (GNU
libgomp in the PyPI wheels), and libgomp gives EVERY thread that opens a parallel region its own
team of workers, kept until that thread exits. libgomp counts the threads of all teams; when
they outnumber the CPUs it stops spinning at its barriers (about 100 pause instructions instead
of 300,000) and parks the workers in futex sleeps, so every parallel region of every forward pays
a sleep/wake round trip. The server had two teams: a forward thread's (engine/faults.py ran
forwards on a thread, for the model timeout) and the engine thread's (KV-cache reservation,
sampling), 3 managed threads on 2 cores, and decoded at 0.6x the Python API's speed
(docs/serving-performance.md). On n cores with n torch threads it is 2n - 1 > n as well.

So in the server exactly one thread runs parallel torch work:
- the engine thread, which runs every model's forwards itself (the model timeout is a
  watchdog that replaces a hung engine thread: engine/faults.py, server/async_engine.py;
  the retired thread keeps its team until its forward returns and it exits, so after a hang
  the server serves on, slower, until then);
- set-up (loading the pool, building the router) runs on a thread that ends
  (`on_passing_thread`), so its team is gone before serving starts. The event loop thread
  runs no torch work (it tokenizes with the Rust tokenizer and hands tokens over).
- a thread that set up and stays (an in-process server: `LiveServer` in tests, a notebook that
  loaded the pool on its main thread) gives its team back: `create_app` (its `Service`) and
  `LiveServer.start` call `release_omp_team_here` (OpenMP 5's `omp_pause_resource_all`:
  libgomp ends the calling thread's team and stops counting it; torch makes a new one if that
  thread runs parallel work again).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T], name: str = "specrouter-setup") -> T:
    """`fn()` on a new thread that ends when it returns (its OpenMP team with it); its result,
    or its exception re-raised here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@functools.cache
def _libgomp():
    """The libgomp torch runs on (found in this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def release_omp_team_here() -> bool:
    """End the OpenMP team of the calling thread (its workers exit; a later parallel region on
    this thread starts a new one). True if it was done (or there was none), False where it
    cannot be (no libgomp, an OpenMP before 5.0, or inside a parallel region)."""
    lib = _libgomp()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft


def freeze_heap() -> int:
    """Collect, then move every object alive into the collector's permanent generation
    (`gc.freeze`): the serving process's set-up leaves ~330,000 tracked objects (modules, the pool,
    the app), and a generation-2 collection walked them all, 120 ms with every thread that needs
    the GIL stalled (the event loop, the engine thread between its kernels); two of them fell in
    the first requests of a fresh server (docs/serving-performance.md, fifteenth round). After
    the freeze a full collection walks only what serving created: ~0 ms. For a process that
    serves one app for its life (`specrouter serve`): frozen objects are never collected, so a
    caller that later drops what it set up would keep it. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
