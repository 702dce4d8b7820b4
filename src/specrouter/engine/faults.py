"""Fault tolerance: a pool model that raises, or hangs, is taken out of the chains.

`GuardedRunner` wraps a `ModelRunner` (same interface): its forwards run in a worker thread
with a timeout, and an exception or a timeout becomes `ModelFailure(model, cause)`. The runners
of one `guard_runners` call share ONE forward thread (`ForwardThread`): every thread that runs
torch's parallel kernels gets its own OpenMP team, and more teams than cores make libgomp sleep
at every barrier (docs/serving-performance.md); a forward that times out abandons the shared
thread and the next forward starts a fresh one. The engine
catches it around a cycle (`Engine.step`) and calls `Engine._on_model_failure`, which

1. logs it (logger "specrouter.engine.faults", the fields also in `extra`) and counts it
   (`engine.on_model_failure` hook: the server's metric);
2. marks the model failed (`engine.failed_models`): it is dropped from every chain from now on;
3. rolls the rows back to their committed tokens: `StateManager.commit` with nothing new drops
   every model's speculative tokens and keeps the last committed token pending, so the next
   cycle starts from a consistent state (the failed cycle committed nothing);
4. returns the chain without the failed model, which the engine retries in the same step
   (a model failing outside the chain, e.g. in a probe, is taken out and the same chain retried).

The target failing is fatal for the rows of that cycle: they finish with finish_reason "error"
(there is no other model whose output is the target's). A target that raised stays in service
(the next request may succeed); a target that timed out is marked failed, because its hung
worker thread may still write into its caches: the engine cannot serve any more.

A hung worker thread cannot be killed in Python: it is a daemon, abandoned; the runner refuses
every later forward.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading

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


class _Worker:
    """One daemon thread that runs forwards handed to it, one at a time."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, arg, box, done = job
            try:
                box.append((True, fn(arg)))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append((False, e))
            done.set()

    def run(self, fn, arg, timeout: float):
        """fn(arg) in the worker; raises TimeoutError if it does not return within `timeout`."""
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, arg, box, done))
        if not done.wait(timeout):
            raise TimeoutError(f"forward did not return within {timeout:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)


class ForwardThread:
    """The worker thread the forwards of a set of guarded runners run on, started on the first
    forward; `abandon()` leaves a hung one behind (the next forward starts a new one)."""

    def __init__(self, name: str = "specrouter-forward"):
        self.name = name
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    def run(self, fn, arg, timeout: float):
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(self.name)
            worker = self._worker
        return worker.run(fn, arg, timeout)

    def abandon(self) -> threading.Thread | None:
        """Stop using the current thread (it exits if its forward ever returns); returns it."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return None
        worker.stop()
        return worker.thread

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
            worker.thread.join(timeout=5)


class GuardedRunner(ModelRunner):
    """A `ModelRunner` whose model calls (`forward`, and where the wrapped runner has them the
    target's `forward_with_features` and a draft head's `step`) raise `ModelFailure` on an
    exception or after `timeout` seconds (None: no timeout, the call runs in the caller's
    thread) on `thread` (shared with other runners, or the runner's own). Everything else
    (slots, reserve, attributes) is the wrapped runner's: every attribute `ModelRunner` defines
    (`packs_ragged`, `parking`, `generation`, `kv_bytes_per_position`, `copy_slot`, ...) reads
    the wrapped runner's, never the base class's default (`_forward_base_attributes`)."""

    def __init__(self, inner: ModelRunner, timeout: float | None, thread: ForwardThread | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"model timeout must be > 0 seconds, got {timeout!r}")
        self.__dict__["inner"] = inner
        self.__dict__["timeout"] = timeout
        self.__dict__["failed"] = None  # ModelFailure of a timeout: the runner is unusable
        self.__dict__["thread"] = thread or ForwardThread(f"specrouter-forward-{inner.name}")
        self.__dict__["abandoned"] = []  # threads of timed-out forwards (daemons, left running)
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

    def _guarded(self, call: str, *args):
        """`inner.<call>(*args)`, a failure or a timeout raised as ModelFailure."""
        if self.failed is not None:
            raise self.failed
        if self.timeout is None:
            try:
                return getattr(self.inner, call)(*args)
            except Exception as e:
                raise ModelFailure(self.inner.name, e) from e
        try:  # torch's grad mode is thread-local: the worker runs in inference mode like the runners
            return self.thread.run(_call_no_grad, (getattr(self.inner, call), args), self.timeout)
        except TimeoutError as e:
            failure = ModelFailure(self.inner.name, e)
            self.__dict__["failed"] = failure
            hung = self.thread.abandon()  # it exits if the forward ever returns; abandoned otherwise
            if hung is not None:
                self.abandoned.append(hung)
            raise failure from e
        except Exception as e:
            raise ModelFailure(self.inner.name, e) from e

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.inner.reserve(num_slots, max_len)

    def allocate_slot(self) -> int:
        return self.inner.allocate_slot()

    def free_slot(self, slot: int) -> None:
        self.inner.free_slot(slot)

    def close(self) -> None:
        """Stop the forward thread (a hung one was already abandoned)."""
        self.thread.close()


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


def _call_no_grad(args):
    fn, call_args = args
    with torch.inference_mode():
        return fn(*call_args)


def guard_runners(runners: dict[str, ModelRunner], timeout: float | None) -> dict[str, ModelRunner]:
    """The runners, each wrapped in a `GuardedRunner` (already wrapped ones are kept); the newly
    wrapped ones share one forward thread."""
    thread = ForwardThread()
    return {n: r if isinstance(r, GuardedRunner) else GuardedRunner(r, timeout, thread)
            for n, r in runners.items()}


def without_failed(chain: tuple[str, ...], failed: set[str], target: str) -> tuple[str, ...]:
    """`chain` without failed models (the target is kept: without it there is no output)."""
    if not failed:
        return chain
    return tuple(m for m in chain if m not in failed or m == target)
