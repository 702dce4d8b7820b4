"""Fault tolerance: a pool model that raises, or hangs, is taken out of the chains.

`GuardedRunner` wraps a `ModelRunner` (same interface): an exception in a forward becomes
`ModelFailure(model, cause)`, raised in the caller's thread. The forwards run on the caller's
thread (in the server: the engine thread, with torch's threads; no hand-off per forward). A
hang is caught by a watchdog (`ForwardWatch`, shared by the runners of one `guard_runners` call):
each forward records its start; the watchdog thread sleeps until the deadline of the forward in
flight (about one wake-up per timeout) and, when a forward passes `timeout` seconds, **retires**
the thread running it and tells its owner (`on_hang`, the server's `AsyncEngine`), which starts a
fresh engine loop on a new thread. The retired thread is left behind (Python cannot kill a
thread); if its forward ever returns, the guard raises `Retired` (a BaseException: no
`except Exception` on the way catches it) and the thread unwinds without touching anything.

A failure, raised or timed out, is handled by the engine (`Engine.step` around a cycle, or
`Engine.recover_from_hang` for a retired cycle), which

1. logs it (logger "specrouter.engine.faults", the fields also in `extra`) and counts it
   (`engine.on_model_failure` hook: the server's metric);
2. marks the model failed (`engine.failed_models`): it is dropped from every chain from now on;
3. rolls the rows back to their committed tokens: `StateManager.commit` with nothing new drops
   every model's speculative tokens and keeps the last committed token pending, so the next
   cycle starts from a consistent state (the failed cycle committed nothing);
4. returns the chain without the failed model, which the engine retries in the same step (or
   the fresh loop's next step, after a hang).

The target failing is fatal for the rows of that cycle: they finish with finish_reason "error"
(there is no other model whose output is the target's). A target that raised stays in service
(the next request may succeed); a target that timed out is marked failed, because its hung
forward may still write into its caches: the engine cannot serve any more.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrouter.errors import SpecRouterError
from specrouter.models.runners.base import ForwardBatch, ModelRunner

logger = logging.getLogger("specrouter.engine.faults")  # the engine logs failures here


class ModelFailure(SpecRouterError):
    """A pool model raised or timed out during a forward."""

    def __init__(self, model: str, cause: BaseException):
        self.model = model  # pool name of the failed model
        self.cause = cause  # the exception it raised, or a TimeoutError
        self.kind = "timeout" if isinstance(cause, TimeoutError) else "exception"
        super().__init__(f"model {model!r} failed ({self.kind}): {type(cause).__name__}: {cause}")


class Retired(BaseException):
    """Raised in a thread whose hung forward returned after the watchdog retired it: the
    thread's work was handed to another one, so it must unwind and touch nothing (a
    BaseException, so that no `except Exception` on the way treats it as a failure)."""


@dataclass(eq=False)
class _InFlight:
    """One forward being run."""

    runner: "GuardedRunner"  # the model's guard
    thread: threading.Thread  # the thread running it
    started: float  # clock() when it started
    retired: bool = False  # the watchdog gave up on it: its thread must unwind


class ForwardWatch:
    """The deadline of every guarded forward in flight, and the watchdog thread that enforces it.

    `begin`/`end` bracket a forward (a lock and a dict entry: no thread is woken). `start(on_hang)`
    runs the watchdog: it sleeps until the earliest deadline in flight (or `timeout` when none is),
    and when a forward is overdue it retires it (its runner refuses every later call:
    `GuardedRunner.mark_timed_out`) and calls `on_hang(failure, thread)` on the watchdog thread
    (`failure`: ModelFailure with a TimeoutError). Without `start` the deadlines
    are recorded and not enforced (an offline `Engine`: nobody could take over its caller's
    work)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        if not timeout > 0:
            raise ValueError(f"model timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._inflight: dict[threading.Thread, _InFlight] = {}
        self._wake = threading.Event()  # stop() sets it
        self._thread: threading.Thread | None = None
        self.retired: list[threading.Thread] = []  # threads the watchdog gave up on

    # -- the forwards' side ---------------------------------------------------------------------
    def begin(self, runner: GuardedRunner) -> _InFlight:
        me = threading.current_thread()
        entry = _InFlight(runner, me, self.clock())
        with self._lock:
            self._inflight[me] = entry
        return entry

    def end(self, entry: _InFlight) -> None:
        """The forward of `entry` returned (or raised); raises `Retired` if the watchdog gave up
        on it meanwhile."""
        with self._lock:
            if self._inflight.get(entry.thread) is entry:
                del self._inflight[entry.thread]
            if entry.retired:
                raise Retired(f"{entry.thread.name}: the forward of {entry.runner.name!r} returned after "
                              f"the watchdog retired this thread")

    # -- the watchdog ---------------------------------------------------------------------------
    def start(self, on_hang: Callable[[ModelFailure, threading.Thread], None]) -> None:
        if self._thread is not None:
            raise RuntimeError("the watchdog is already running")
        self._wake.clear()
        self._thread = threading.Thread(target=self._watch, args=(on_hang,), name="specrouter-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def overdue(self) -> list[_InFlight]:
        """Retire every forward past its deadline; returns them."""
        now = self.clock()
        with self._lock:
            late = [e for e in self._inflight.values() if now - e.started >= self.timeout]
            for e in late:
                e.retired = True
                del self._inflight[e.thread]
                self.retired.append(e.thread)
        return late

    def _next_wait(self) -> float:
        with self._lock:
            first = min((e.started for e in self._inflight.values()), default=None)
        if first is None:
            return self.timeout  # a forward starting now is due no earlier than that
        return max(first + self.timeout - self.clock(), 0.001)

    def _watch(self, on_hang) -> None:
        while not self._wake.wait(self._next_wait()):
            for e in self.overdue():
                failure = ModelFailure(e.runner.name, TimeoutError(
                    f"forward did not return within {self.timeout:g} s"))
                e.runner.mark_timed_out(failure)
                try:
                    on_hang(failure, e.thread)
                except Exception:  # noqa: BLE001 - the watchdog must keep watching
                    logger.exception("handling the hang of %r failed", e.runner.name)


class GuardedRunner(ModelRunner):
    """A `ModelRunner` whose model calls (`forward`, and where the wrapped runner has them the
    target's `forward_with_features` and a draft head's `step`) raise `ModelFailure` on an
    exception, run on the caller's thread, each under `watch`'s deadline (None: no timeout).
    A model whose forward timed out (`mark_timed_out`, by the watch's owner) refuses every
    later call. Everything else (slots, reserve, attributes) is the wrapped runner's: every
    attribute `ModelRunner` defines (`packs_ragged`, `parking`, `generation`,
    `kv_bytes_per_position`, `copy_slot`, ...) reads the wrapped runner's, never the base
    class's default (`_forward_base_attributes`)."""

    def __init__(self, inner: ModelRunner, watch: ForwardWatch | None = None):
        self.__dict__["inner"] = inner
        self.__dict__["watch"] = watch
        self.__dict__["failed"] = None  # ModelFailure of a timeout: the runner is unusable
        # the wrapped runner's other model calls, guarded like `forward` (instance attributes:
        # a runner without them still has none)
        for call in GUARDED_CALLS:
            if callable(getattr(inner, call, None)):
                self.__dict__[call] = functools.partial(self._guarded, call)

    def __getattr__(self, attr):  # name, vocab_size, max_len, num_slots, ... of the wrapped runner
        return getattr(self.__dict__["inner"], attr)

    def __setattr__(self, attr, value):
        setattr(self.inner, attr, value)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._guarded("forward", batch)

    def mark_timed_out(self, failure: ModelFailure) -> None:
        """The model hung: refuse every later call with `failure`."""
        self.__dict__["failed"] = failure

    def _guarded(self, call: str, *args):
        """`inner.<call>(*args)`, a failure raised as ModelFailure."""
        if self.failed is not None:
            raise self.failed
        fn = getattr(self.inner, call)
        if self.watch is None:
            try:
                return fn(*args)
            except Exception as e:
                raise ModelFailure(self.inner.name, e) from e
        entry = self.watch.begin(self)
        try:
            out = fn(*args)
        except Exception as e:
            self.watch.end(entry)  # raises Retired if this thread was retired meanwhile
            raise ModelFailure(self.inner.name, e) from e
        self.watch.end(entry)
        return out

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.inner.reserve(num_slots, max_len)

    def allocate_slot(self) -> int:
        return self.inner.allocate_slot()

    def free_slot(self, slot: int) -> None:
        self.inner.free_slot(slot)


# model calls besides `forward` that run a model (the target's forward that also returns the
# features a draft head reads; a head level's step), guarded where the wrapped runner has them
GUARDED_CALLS = ("forward_with_features", "step")


def _forward_base_attributes() -> None:
    """Make every attribute `ModelRunner` defines at class level (defaults such as
    `packs_ragged = False`, `parking`, `generation`, and methods such as `kv_bytes_per_position`,
    `copy_slot`, `reallocating`) read the wrapped runner's on a `GuardedRunner`: inherited, they
    would shadow `__getattr__` (which only sees names the class lacks) and answer with the base
    class's defaults (a guarded native runner that packs ragged batches claimed it pads)."""
    own = set(vars(GuardedRunner))
    for attr in vars(ModelRunner):
        if attr.startswith(("__", "_abc")) or attr in own:
            continue
        setattr(GuardedRunner, attr, property(lambda self, _a=attr: getattr(self.__dict__["inner"], _a)))


_forward_base_attributes()


def guard_runners(runners: dict[str, ModelRunner], watch: ForwardWatch | None) -> dict[str, ModelRunner]:
    """The runners, each wrapped in a `GuardedRunner` under `watch` (already wrapped ones are
    kept)."""
    return {n: r if isinstance(r, GuardedRunner) else GuardedRunner(r, watch) for n, r in runners.items()}


def without_failed(chain: tuple[str, ...], failed: set[str], target: str) -> tuple[str, ...]:
    """`chain` without failed models (the target is kept: without it there is no output)."""
    if not failed:
        return chain
    return tuple(m for m in chain if m not in failed or m == target)
