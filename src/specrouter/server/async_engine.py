"""The background loop: ONE thread owns the Engine; the asyncio side only talks to it.

Continuous batching: the thread loops `engine.step()` while rows exist. Between steps it
1. applies aborts (client gone, stop string found) with `engine.abort`, which frees the state;
2. admits waiting requests in FIFO order with `engine.add_request` until it raises
   `CapacityError` (all `max_num_seqs` slots taken): the head of the queue waits for a row to
   finish; nothing overtakes it. A batch that starts on an idle engine first waits (at most
   `admission_wait`, 20 ms) while other requests are on their way: ARRIVING (received, not yet
   submitted: the handlers hold `arriving()` from reading the body to submitting the rows), or
   expected: one within `admission_linger` (2 ms) of the last arrival, unless as many requests
   came as rows ended last (their clients' next requests: `_gather`), so requests sent together
   start together, in one step, as the in-process engine's batch does: admitted one by one, the
   first ran a lone prefill step (40 ms at c=8, while the loop parsed the others) and its row ran
   one step ahead of the rest to the end (docs/serving-performance.md). Nothing waits at c=1
   after a request (its row ended, its client's next request came) or while rows run (a
   newcomer joins at the next step).
After each step, the new tokens of every row that reads them step by step go to the requests'
asyncio queues in one `loop.call_soon_threadsafe` call (a row submitted with `per_step=False`, a
whole response with no stop string and no logprobs, reads nothing before its end: it gets one
event when it finishes, and a step none of whose rows needs a hand-off makes none, as in-process
generation; a stream with `ServerConfig.stream_interval` n > 1 gets one every n steps while other
rows run, its first and last tokens at once; n = 0, the default, paces streams by what a
hand-off costs on this machine, a lone stream's too: `StreamPacer`), and the engine thread waits (at most `handoff_wait`, 2 ms)
until the event loop has taken them and run what they woke (SSE chunks written): the loop's
per-step work then runs while no forward does, instead of preempting one of the forward's
OpenMP threads and taking the GIL from the engine thread mid-forward (with the 0.5 ms GIL
switch interval of cli/serve.py: +3-8% paired, docs/serving-performance.md). The waiting
queue is bounded: `submit` raises `QueueFull` (the server answers 429 with Retry-After) when
it holds `max_queue` requests.

torch work never runs on the event loop; the event loop never blocks on the engine. The engine
thread runs the forwards itself, with torch's threads: the process's only OpenMP team
(server/threads.py). A model timeout is a watchdog (`ForwardWatch`, engine/faults.py): when a
forward hangs it retires the engine thread and calls `_on_hang`, which starts a fresh engine
thread; that one first recovers (`Engine.recover_from_hang`: the model out, the rows back to
their committed tokens; what the abandoned step committed before the hang is delivered: every
request counts the tokens it was sent, `RequestHandle.sent`) and then carries on with the same
rows and queue. The retired thread, if its forward ever returns, unwinds touching nothing
(`Retired`). While another process takes one of the cores its threads count on, the engine
thread runs on fewer torch threads (`TeamGovernor`, engine/contention.py: a team sharing one core
spins through its barriers, a 2-row step took 8x its time).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from specrouter.config import SamplingParams
from specrouter.engine.engine import CapacityError, Engine, StepOutput
from specrouter.engine.faults import ForwardWatch, ModelFailure, Retired
from specrouter.engine.contention import TeamGovernor
from specrouter.state.sequence import Sequence

logger = logging.getLogger("specrouter.server")


HANDOFF_WAIT_S = 0.002  # the most the engine thread waits for the event loop to take a step's tokens
ADMISSION_WAIT_S = 0.02  # the most an idle engine waits for requests still arriving before it starts
ADMISSION_LINGER_S = 0.002  # ... and for another request after the last one arrived (no batch just ended)
STREAM_BUDGET = 0.015  # the share of the engine's time the hand-offs of held streams may take (StreamPacer)
MAX_HOLD_S = 0.1  # the longest a held stream's tokens wait for their chunk (StreamPacer)
MAX_HOLD_LONE_S = 0.05  # ... a lone paced stream's (c=1: its reader waits for nobody else's tokens)
PACE_START = 2  # StreamPacer's interval before it has measured a step and a hand-off
PACE_EMA = 0.1  # weight of the newest step / hand-off in StreamPacer's running means
IDLE_FOLD_S = 0.05  # an engine idle this long folds its queued metrics in (ServerMetrics.flush)


class QueueFull(Exception):
    """The waiting queue is full: try again later."""


@dataclass
class TokenEvent:
    """What the engine thread reports to one request."""

    token_ids: list[int]  # tokens committed since the last event
    done: bool = False  # the row finished (or failed, or was refused)
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    stats: dict | None = None  # RequestStats.as_dict() when done
    error: str | None = None  # why, when finish_reason == "error"
    committed: float = 0.0  # perf_counter time the engine step that committed them ended
    logprobs: list | None = None  # TokenLogprob per token (requests asking for logprobs)
    prompt_logprobs: list | None = None  # the prompt's (requests asking), once computed


@dataclass(eq=False)
class RequestHandle:
    """One submitted request, seen from the asyncio side."""

    prompt: list[int]
    params: SamplingParams
    chain: tuple[str, ...] | None
    k: int
    generator: torch.Generator | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None  # set when the engine admits it
    seq: Sequence | None = None  # the engine's row, once admitted
    sent: int = 0  # tokens of seq.tokens (prompt included) events have carried so far
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # perf_counter time it started running
    tenant: str | None = None  # whose learned drafter statistics it uses (None: shared)
    per_step: bool = True  # an event after every step with new tokens (False: one when done)
    # per_step rows: steps one event may hold while other rows run (ServerConfig.stream_interval;
    # 0: the engine's StreamPacer decides)
    interval: int = 1
    held: int = 0  # steps since its last event whose tokens wait for the next (interval > 1)
    first_commit: float | None = None  # perf_counter time of the step that committed its first token
    finished: bool = False  # done event delivered, or aborted


class StreamPacer:
    """The stream interval when `ServerConfig.stream_interval` is 0 (the default): the steps a
    held stream's chunk may carry while other rows run, from what a hand-off costs here.

    A hand-off (the engine thread waking the event loop, the loop writing the due rows' chunks,
    the engine thread running again) costs a fixed ~0.35-0.4 ms plus ~40 us a row on a 2-core
    Sapphire Rapids (docs/serving-performance.md, thirteenth round): 4% of a 14 ms batched step
    when made every step. So the interval is the fewest steps that keep the hand-offs within
    `budget` of the engine's time, `ceil(handoff / (budget * step))` over running means of both,
    and never more than `max_hold` seconds of steps (a chunk at least that often): 4-7 steps at
    c=4 / c=8 there (by the chunks a level carried; the hand-offs' running mean includes the
    heavier first and last ones of a batch), 1-2 on a CPU whose steps are 40-80 ms (a hand-off is a small part of them).
    A lone stream (c=1) is paced by the same rule within `max_hold_lone` (`lone`): a hand-off a
    step was ~3.5% of a 10 ms single-row step there, what streaming cost a c=1 request
    (docs/serving-performance.md, fourteenth round); 3 steps, a chunk every ~30 ms, keep it
    within the budget. Only the engine thread calls it."""

    def __init__(self, budget: float = STREAM_BUDGET, max_hold: float = MAX_HOLD_S,
                 start: int = PACE_START, weight: float = PACE_EMA, max_hold_lone: float = MAX_HOLD_LONE_S):
        self.budget, self.max_hold, self.weight = budget, max_hold, weight
        self.max_hold_lone = max_hold_lone
        self.step: float | None = None  # running mean of an engine step's wall seconds
        self.handoff: float | None = None  # running mean of a hand-off's (the engine thread's wait)
        self.interval = start  # steps a paced stream's chunk may hold while other rows run
        self.lone = start  # ... a lone paced stream's

    def observe_step(self, seconds: float) -> None:
        self.step = self._mean(self.step, seconds)
        self._pace()

    def observe_handoff(self, seconds: float) -> None:
        self.handoff = self._mean(self.handoff, seconds)

    def _mean(self, mean: float | None, x: float) -> float:
        return x if mean is None else mean + self.weight * (x - mean)

    def _pace(self) -> None:
        if self.step is None or self.handoff is None or self.step <= 0:
            return
        n = math.ceil(self.handoff / (self.budget * self.step))
        self.interval = max(1, min(n, int(self.max_hold / self.step)))
        self.lone = max(1, min(n, int(self.max_hold_lone / self.step)))


class AsyncEngine:
    """Runs `engine` in a background thread; see the module docstring."""

    def __init__(self, engine: Engine, *, max_queue: int = 64, metrics=None, seed: int | None = None,
                 watch: ForwardWatch | None = None, handoff_wait: float = HANDOFF_WAIT_S,
                 admission_wait: float = ADMISSION_WAIT_S, admission_linger: float = ADMISSION_LINGER_S,
                 governor: TeamGovernor | None = None):
        self.engine = engine
        # the engine thread's torch threads while another process takes a core (contention.py;
        # None: always its own count). Service builds it from ServerConfig.team_governor
        self.governor = governor
        self.handoff_wait = handoff_wait  # seconds (0: hand tokens over without waiting)
        self.pacer = StreamPacer()  # the interval of streams submitted with interval 0
        if metrics is not None:
            metrics.stream_interval.set(self.pacer.interval)
        self.admission_wait = admission_wait  # seconds (0: an idle engine starts at once)
        self.admission_linger = admission_linger  # seconds (`_gather`)
        self.watch = watch  # the guarded runners' deadlines (None: no model timeout)
        self.max_queue = max_queue
        self.metrics = metrics
        self._generator = torch.Generator()
        self._generator.manual_seed(seed if seed is not None else torch.seed())
        engine.rng = self._generator  # the seeds of requests without one
        self._cv = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._aborts: list[RequestHandle] = []
        self._arriving = 0  # requests received and not yet submitted (`arriving`)
        self._last_arrival = -math.inf  # perf_counter time the latest `arriving` began
        # rows that ended within `admission_wait` of each other up to the latest end, less the
        # requests admitted since, and when that end was: their clients' next requests are on
        # their way (`_gather`, when the engine is empty)
        self._returning, self._idle_since = 0, -math.inf
        self._by_seq: dict[int, RequestHandle] = {}
        self._gauged: tuple[int, int] | None = None  # the gauges' values last set (`_gauges`)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set if the loop itself died
        self.retired: list[threading.Thread] = []  # engine threads left in a hung forward

    # -- asyncio side -----------------------------------------------------------------------
    def start(self) -> None:
        with self._cv:
            self._thread = self._spawn(None)
        if self.watch is not None:
            self.watch.start(self._on_hang)

    def _spawn(self, recover: ModelFailure | None) -> threading.Thread:
        t = threading.Thread(target=self._run, args=(recover,), name="specrouter-engine", daemon=True)
        t.start()
        return t

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @contextlib.contextmanager
    def arriving(self):
        """Held by a request's handler from reading its body until its rows are submitted (or
        it failed): an idle engine about to start a batch waits for it (`admission_wait`)."""
        with self._cv:
            self._arriving += 1
            self._last_arrival = time.perf_counter()
        try:
            yield
        finally:
            with self._cv:
                self._arriving -= 1
                self._cv.notify_all()

    def submit(self, prompt: list[int], params: SamplingParams, *, chain: tuple[str, ...] | None,
               k: int, generator: torch.Generator | None = None, tenant: str | None = None,
               per_step: bool = True, interval: int = 1) -> RequestHandle:
        """Queue a request (validated by the caller with `engine.check_request`); `tenant` keeps
        learned drafter statistics apart (ServerConfig.suffix_scope); `per_step=False`: its events
        are the tokens in one, when it finishes (a caller that reads nothing before the end);
        `interval` > 1: while other rows run, one event per `interval` steps (`_events`)."""
        handle = RequestHandle(prompt=prompt, params=params, chain=chain, k=k, generator=generator,
                               loop=asyncio.get_running_loop(), tenant=tenant, per_step=per_step,
                               interval=interval)
        with self._cv:
            if self._stop or not self.alive:
                raise RuntimeError("the engine is not running")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is "
                                f"{self.max_queue}); retry later")
            self._waiting.append(handle)
            self._gauges()
            self._cv.notify()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Drop a request (client gone, stop string reached); frees its row."""
        with self._cv:
            if handle.finished:
                return
            handle.finished = True
            try:
                self._waiting.remove(handle)
                self._gauges()
                return
            except ValueError:
                pass
            self._aborts.append(handle)
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; running and waiting requests end with an error event."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        while (t := self._thread) is not None:  # a hang meanwhile hands the loop to a new thread
            t.join(max(deadline - time.monotonic(), 0.0))
            if t is self._thread or time.monotonic() >= deadline:
                break
        if self.watch is not None:
            self.watch.stop()

    def _on_hang(self, failure: ModelFailure, thread: threading.Thread) -> None:
        """The watchdog retired `thread` in a hung forward (on the watchdog's thread): if it is
        the engine thread, a new one takes over (it recovers first: `_run`)."""
        with self._cv:
            if thread is not self._thread:
                logger.error("a forward of %r hung outside the engine loop (thread %s)",
                             failure.model, thread.name)
                return
            self.retired.append(thread)
            self._thread = self._spawn(failure)

    # -- engine thread ----------------------------------------------------------------------
    def _gauges(self) -> None:
        """queue_depth and running_rows, set when they changed (lock held; twice a step)."""
        now = (len(self._waiting), len(self.engine.running))
        if self.metrics is not None and now != self._gauged:
            self._gauged = now
            self.metrics.queue_depth.set(now[0])
            self.metrics.running_rows.set(now[1])

    def _run(self, recover: ModelFailure | None) -> None:
        engine = self.engine
        me = threading.current_thread()
        try:
            if recover is not None:
                if self.governor is not None:
                    self.governor.reset()  # the new thread runs on the team's own torch threads
                self._recover(recover)
            while True:
                with self._cv:
                    paused = False
                    while not (self._stop or self._waiting or self._aborts or engine.has_unfinished()):
                        paused = True
                        if self.metrics is None or not self.metrics.pending():
                            self._cv.wait()
                        elif not self._cv.wait(IDLE_FOLD_S):  # idle a while: fold the step records
                            self._cv.release()  # in now (lock released: a submit never waits for it),
                            try:  # not at a queue's cap between two steps (metrics.PENDING_MAX)
                                self.metrics.flush()
                            finally:
                                self._cv.acquire()
                    if paused and self.governor is not None:
                        self.governor.wake()  # reduced: were the cores free in the pause? (contention.py)
                    if self._thread is not me:
                        return  # retired (belt and braces: a retired forward raises Retired)
                    if self._stop:
                        break
                    if self._waiting and not engine.running:
                        self._gather(me)  # 0. a batch starting: wait for requests on their way
                    aborts, self._aborts = self._aborts, []
                    for h in aborts:  # 1. aborts
                        if h.seq_id is not None and self._by_seq.pop(h.seq_id, None) is not None:
                            engine.abort(h.seq_id)
                    refused = self._admit()  # 2. admissions
                    self._gauges()
                deliveries = [(h, TokenEvent([], True, "error", error=msg)) for h, msg in refused]
                if engine.has_unfinished():
                    deliveries += self._step()
                if deliveries:
                    self._deliver(deliveries)
        except Retired:
            return  # a new engine thread owns everything now: touch nothing
        except BaseException as e:
            self.error = e
            logger.exception("the engine loop died")
        self._shutdown()

    def _gather(self, me: threading.Thread) -> None:
        """An idle engine with requests waiting: wait (lock held, at most `admission_wait`) while
        more are on their way and the batch has room, so that requests sent together start
        together. On their way: requests whose handlers hold `arriving`, and another request
        within `admission_linger` of the last arrival (requests sent together reach the handlers
        ~1 ms apart: the event loop accepts, parses and tokenizes them one after another), unless
        as many requests came as rows ended last (`_returning`: rows that ended within
        `admission_wait` of each other, less the requests admitted since; a closed-loop client
        sends its next request when its response arrives): then the batch starts at once. So
        nothing waits at c=1 after a request (its one row ended, one request came) nor while
        rows run (a newcomer joins at the next step); a request after a pause waits
        `admission_linger` at most beyond its own handling."""
        now = time.perf_counter()
        deadline = now + self.admission_wait
        expected = self._returning if now - self._idle_since < self.admission_wait else 0
        self._returning = 0  # one batch's clients are awaited once
        room = self.engine.max_num_seqs or math.inf
        while not self._stop and not self._aborts and self._thread is me:
            queued = len(self._waiting)
            now = time.perf_counter()
            if queued >= room or now >= deadline or not queued:
                return
            if self._arriving:
                until = deadline
            elif expected and queued >= expected:
                return  # the clients of the rows that ended last are back
            else:
                until = min(self._last_arrival + self.admission_linger, deadline)
            if now >= until:
                return
            self._cv.wait(until - now)

    def _recover(self, failure: ModelFailure) -> None:
        """Take over from a thread retired in a hung forward (see the module docstring)."""
        with self._cv:
            self.engine.recover_from_hang(failure)
            outputs = [StepOutput(h.seq, h.seq.tokens[h.sent:]) for h in list(self._by_seq.values())]
            deliveries, generated = self._events(outputs, time.perf_counter())  # rows 0: nothing held
            if self.metrics is not None:
                self.metrics.generated_tokens.inc(generated)
            self._gauges()
        if deliveries:
            self._deliver(deliveries)

    def _admit(self) -> list[tuple[RequestHandle, str]]:
        """Admit waiting requests in FIFO order while the engine has room (lock held)."""
        refused = []
        while self._waiting:
            h = self._waiting[0]
            try:
                seq = self.engine.add_request(h.prompt, h.params, chain=h.chain, k=h.k,
                                              generator=h.generator, tenant=h.tenant)
            except CapacityError as e:
                if self.engine.running:
                    break  # wait for a row to finish
                self._waiting.popleft()  # it does not fit even in an empty engine: never will
                h.finished = True
                refused.append((h, str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - validated before; report, do not die
                self._waiting.popleft()
                h.finished = True
                refused.append((h, f"{type(e).__name__}: {e}"))
                continue
            self._waiting.popleft()
            self._returning = max(self._returning - 1, 0)  # one client of the rows that ended is back
            h.seq_id, h.seq, h.sent, h.admitted = seq.seq_id, seq, len(seq.tokens), time.perf_counter()
            self._by_seq[seq.seq_id] = h
        return refused

    def _step(self) -> list[tuple[RequestHandle, TokenEvent]]:
        engine = self.engine
        t0, cpu0 = time.perf_counter(), time.thread_time()
        rows, threads = len(engine.running), torch.get_num_threads()  # this step's torch threads
        try:
            outputs = engine.step()
        except Exception as e:
            logger.exception("engine step failed; the running rows end with an error")
            out = []
            with self._cv:
                for seq_id in list(engine.running):
                    engine.abort(seq_id)
                    h = self._by_seq.pop(seq_id, None)
                    if h is not None:
                        h.finished = True
                        out.append((h, TokenEvent([], True, "error", error=f"{type(e).__name__}: {e}")))
            return out
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        if self.governor is not None:
            self.governor.observe(wall, cpu)
        pace = self.pacer.interval
        self.pacer.observe_step(wall)
        if self.metrics is not None and self.pacer.interval != pace:
            self.metrics.stream_interval.set(self.pacer.interval)
        with self._cv:
            now = time.perf_counter()
            out, generated = self._events(outputs, now, rows)
            if self.metrics is not None:  # folded in when /metrics is scraped (ServerMetrics.flush)
                self.metrics.engine_step(engine.last_step_kind, rows, wall,
                                         sum(len(o.new_token_ids) for o in outputs), threads, cpu, generated)
            ended = sum(1 for o in outputs if o.seq.done)
            if ended:  # their clients' next requests may be on their way (`_gather`)
                recent = self._returning if now - self._idle_since < self.admission_wait else 0
                self._returning, self._idle_since = recent + ended, now
            self._gauges()
        return out

    def _events(self, outputs: list[StepOutput], now: float,
                rows: int = 0) -> tuple[list[tuple[RequestHandle, TokenEvent]], int]:
        """The event of each output's request (lock held), and the tokens the requests got (the
        rows still theirs); finished rows leave `_by_seq`. A
        per_step row with `interval` > 1 in a step of `rows` > 1 rows gets its tokens every
        `interval` steps (a stream interval: fewer chunks to write and parse while the batch
        shares the cores); its first tokens and its last are never held, nor a lone row's
        unless the pacer sets its interval (interval 0: `StreamPacer.lone`, a chunk at least
        every 50 ms; with a fixed interval a lone row gets every step's). `rows` 0 (a
        recovery): nothing is held. A held
        row rides along whenever the step hands something over anyway (another row due, a
        first token, a row's end): the hand-off's fixed cost (two thread wake-ups) is paid once
        for every row it can carry, and rows that joined at different steps fall into one
        phase at the first hand-off they share, instead of a hand-off every step for rows in
        alternate phases."""
        out, held, generated = [], [], 0
        paced = self.pacer.interval if rows > 1 else self.pacer.lone  # of rows submitted with 0
        for o in outputs:
            h = self._by_seq.get(o.seq.seq_id)
            if h is None:  # aborted meanwhile
                continue
            if o.new_token_ids:
                if h.first_commit is None:
                    h.first_commit = now
                generated += len(o.new_token_ids)
            if not (h.per_step or o.seq.done):
                continue  # its tokens wait in seq.tokens[h.sent:] for its end
            interval = h.interval or paced
            if interval > 1 and (rows > 1 or rows == 1 and not h.interval) and not o.seq.done \
                    and h.first_commit != now:
                h.held += 1
                if h.held < interval:
                    held.append((h, o))  # in seq.tokens[h.sent:]: the event `interval` steps on,
                    continue  # or this step's hand-off if it makes one
            self._event(h, o, now, out)
        if out:  # a hand-off is made: the held rows' tokens go with it
            for h, o in held:
                self._event(h, o, now, out)
        return out, generated

    def _event(self, h: RequestHandle, o: StepOutput, now: float,
               out: list[tuple[RequestHandle, TokenEvent]]) -> None:
        """Row `h`'s event with its tokens since the last one (`o`: its output this step), if
        it has any or it finished, onto `out` (lock held)."""
        new = o.seq.tokens[h.sent:]  # this step's, or every token since the last event
        if new:
            h.held = 0
        h.sent = len(o.seq.tokens)
        logprobs = StepOutput(o.seq, new).new_logprobs  # of `new` (held steps' included)
        if o.seq.done:
            del self._by_seq[o.seq.seq_id]
            h.finished = True
            err = (o.seq.error or "a model of the chain failed (see the server log)") \
                if o.seq.finish_reason == "error" else None
            out.append((h, TokenEvent(list(new), True, o.seq.finish_reason,
                                      stats=o.seq.stats.as_dict(), error=err,
                                      committed=now, logprobs=logprobs,
                                      prompt_logprobs=o.seq.prompt_logprobs)))
        elif new:
            out.append((h, TokenEvent(list(new), committed=now,
                                      logprobs=logprobs,
                                      prompt_logprobs=o.seq.prompt_logprobs)))

    def _deliver(self, deliveries: list[tuple[RequestHandle, TokenEvent]]) -> None:
        """Hand the events to their loops; wait until the loops took them (`handoff_wait`)."""
        t0 = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for h, ev in deliveries:
            by_loop.setdefault(h.loop, []).append((h.events, ev))
        taken = []
        for loop, items in by_loop.items():
            done = threading.Event() if self.handoff_wait > 0 else None
            try:
                loop.call_soon_threadsafe(_put_all, items, loop, done)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                continue
            if done is not None:
                taken.append(done)
        if not taken:
            return
        deadline = time.perf_counter() + self.handoff_wait
        for done in taken:
            done.wait(max(deadline - time.perf_counter(), 0.0))
        wall = time.perf_counter() - t0
        self.pacer.observe_handoff(wall)
        if self.metrics is not None:
            self.metrics.handoff(wall)

    def _shutdown(self) -> None:
        with self._cv:
            self._stop = True
            handles = list(self._waiting) + list(self._by_seq.values())
            self._waiting.clear()
            for seq_id in list(self.engine.running):
                self.engine.abort(seq_id)
            self._by_seq.clear()
            for h in handles:
                h.finished = True
            self._gauges()
        self._deliver([(h, TokenEvent([], True, "error", error="the server is shutting down"))
                       for h in handles])


def _put_all(items, loop: asyncio.AbstractEventLoop, done: threading.Event | None) -> None:
    """On the event loop: the events into their queues; `done` set once the tasks they woke ran
    (a callback queued after their wake-ups)."""
    for q, ev in items:
        q.put_nowait(ev)
    if done is not None:
        loop.call_soon(done.set)
