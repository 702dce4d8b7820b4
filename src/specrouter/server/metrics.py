"""Prometheus metrics of one server (its own registry, never the global one).

Names (all prefixed `specrouter_`):
- drafted_tokens_total{drafter,verifier}, accepted_tokens_total{drafter,verifier}: per level of
  every cycle (acceptance rate of a pair = accepted / drafted);
- chain_choices_total{chain}: rows that ran a cycle with that chain ("ngram>draft>target");
- cycle_committed_tokens_total{chain}: target tokens those cycles committed (mean acceptance
  length of a chain = committed / choices); acceptance_length: histogram of the mean tokens
  committed per row in each cycle;
- forward_seconds{model}: wall time of a model's forwards within one cycle;
  forward_tokens_total{model}: tokens fed to it;
- step_seconds: one engine step (all groups); queue_depth, running_rows: gauges;
- steps_by_kind_total{kind,rows}, steps_by_kind_seconds_total{kind,rows},
  steps_by_kind_tokens_total{kind,rows}: engine steps by kind (`Engine.last_step_kind`: "held"
  plain under the router's hold (the step starting it included), "plain" planned plain
  without a hold or no router, "spec" some row drafted) and
  batch size, their summed seconds and the tokens they committed (issue 26: why a router server
  loses to plain batching); plan_cycles_total{chain,k}, plan_committed_tokens_total{chain,k}:
  row-cycles of each chain by draft length (the largest of its rows that step) and the target
  tokens they committed (mean acceptance length per plan = committed / cycles);
- steps_by_threads_total{threads}, steps_by_threads_seconds_total{threads},
  steps_by_threads_cpu_seconds_total{threads}: engine steps by the torch threads they ran on, their
  wall seconds and the engine thread's CPU seconds in them (cpu / wall is the share `TeamGovernor`
  reads); engine_threads: the engine thread's torch threads now; governor_changes_total{change}:
  the governor's "drop"s and "restore"s (engine/contention.py);
- generated_tokens_total (tokens/s = rate()); requests_total{endpoint,status};
  request_seconds{endpoint}: end to end; time_to_first_token_seconds;
- stream_delivery_seconds: a streamed token's engine commit (end of the engine step) to its SSE
  chunk handed to the socket (issue 34: streaming costs nothing extra);
- model_failures_total{model,kind}: forwards that raised ("exception") or hung ("timeout");
- learned_tokens{drafter}, learned_bytes{drafter}, learned_requests{drafter},
  learned_tenants{drafter}, learned_evicted_requests{drafter}: what a learning drafter (suffix)
  holds now (its memory bound and evictions), read when /metrics is scraped;
- prefix_cache_{lookups,hits,prompt_tokens,cached_tokens,evictions} (cumulative),
  prefix_cache_hit_rate (hits / lookups), prefix_cache_token_hit_rate (cached / prompt tokens),
  prefix_cache_{bytes,entries,budget_bytes}: the prefix cache (state/prefix_cache.py), read
  when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import collections
import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specrouter.records.stats import CycleStats

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DELIVERY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_REQUEST = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# engine-thread observations held before the engine thread folds them in itself (nobody scrapes and
# the engine is never idle for AsyncEngine's IDLE_FOLD_S): ~1.5 ms of its time every ~440 steps
PENDING_MAX = 1024


def observe_all(hist, values: list[float]) -> None:
    """`hist.observe(v)` for every v (a Histogram without labels or a labelled child), as one
    count per bucket and one sum: prometheus_client keeps a histogram as the count of each bucket
    alone (`_buckets`, the first upper bound >= the value) and `_sum`, each behind a lock taken per
    observe(). Falls back to observe() if those are not there."""
    bounds, buckets, total = getattr(hist, "_upper_bounds", None), getattr(hist, "_buckets", None), \
        getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            hist.observe(v)
        return
    counts = collections.Counter(bisect.bisect_left(bounds, v) for v in values)
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "specrouter_"
        self.drafted = Counter(p + "drafted_tokens", "Candidates reaching a verifier level",
                               ["drafter", "verifier"], registry=r)
        self.accepted = Counter(p + "accepted_tokens", "Candidates a verifier level accepted",
                                ["drafter", "verifier"], registry=r)
        self.chain_choices = Counter(p + "chain_choices", "Row-cycles run with each chain",
                                     ["chain"], registry=r)
        self.committed = Counter(p + "cycle_committed_tokens",
                                 "Target tokens committed by cycles of each chain", ["chain"],
                                 registry=r)
        self.acceptance_length = Histogram(
            p + "acceptance_length", "Mean tokens committed per row in one cycle (bonus included)",
            buckets=tuple(range(1, 18)), registry=r)
        self.forward_seconds = Histogram(p + "forward_seconds",
                                         "Wall time of one model's forwards in one cycle",
                                         ["model"], buckets=_LATENCY, registry=r)
        self.forward_tokens = Counter(p + "forward_tokens", "Tokens fed to each model",
                                      ["model"], registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "One engine step over all rows",
                                      buckets=_LATENCY, registry=r)
        self.steps_by_kind = Counter(p + "steps_by_kind", "Engine steps by kind and batch size",
                                     ["kind", "rows"], registry=r)
        self.steps_by_kind_seconds = Counter(p + "steps_by_kind_seconds", "Seconds of those steps",
                                             ["kind", "rows"], registry=r)
        self.steps_by_kind_tokens = Counter(p + "steps_by_kind_tokens", "Tokens those steps committed",
                                            ["kind", "rows"], registry=r)
        self.steps_by_threads = Counter(p + "steps_by_threads", "Engine steps by the torch threads they ran on",
                                        ["threads"], registry=r)
        self.steps_by_threads_seconds = Counter(p + "steps_by_threads_seconds", "Wall seconds of those steps",
                                                ["threads"], registry=r)
        self.steps_by_threads_cpu = Counter(p + "steps_by_threads_cpu_seconds",
                                            "The engine thread's CPU seconds in those steps", ["threads"], registry=r)
        self.engine_threads = Gauge(p + "engine_threads", "The engine thread's torch threads now", registry=r)
        self.stream_interval = Gauge(p + "stream_interval", "Steps a paced stream's chunk may hold while other "
                                     "rows run, now (server/async_engine.py StreamPacer)", registry=r)
        self.handoffs = Counter(p + "handoffs", "Hand-offs of step tokens to the event loop the engine "
                                "thread waited for", registry=r)
        self.handoff_seconds = Counter(p + "handoff_seconds", "Seconds the engine thread spent in them",
                                       registry=r)
        self.governor_changes = Counter(p + "governor_changes", "TeamGovernor's thread count changes",
                                        ["change"], registry=r)
        self.plan_cycles = Counter(p + "plan_cycles", "Row-cycles run with each chain and draft length",
                                   ["chain", "k"], registry=r)
        self.plan_committed = Counter(p + "plan_committed_tokens",
                                      "Target tokens committed by the row-cycles of each chain and draft length",
                                      ["chain", "k"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a row", registry=r)
        self.running_rows = Gauge(p + "running_rows", "Rows in the running batch", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(p + "request_seconds", "End-to-end request latency",
                                         ["endpoint"], buckets=_REQUEST, registry=r)
        self.ttft_seconds = Histogram(p + "time_to_first_token_seconds",
                                      "Submission to first generated token", buckets=_REQUEST,
                                      registry=r)
        self.stream_delivery_seconds = Histogram(
            p + "stream_delivery_seconds",
            "Engine commit of a streamed token to its SSE chunk handed to the socket",
            buckets=_DELIVERY, registry=r)
        self.model_failures = Counter(p + "model_failures", "Model forwards that failed",
                                      ["model", "kind"], registry=r)
        self.learned = {f: Gauge(p + "learned_" + f, help_, ["drafter"], registry=r) for f, help_ in (
            ("tokens", "Tokens of earlier requests a learning drafter keeps"),
            ("bytes", "Bytes a learning drafter's global trees take (buffer + index)"),
            ("requests", "Earlier requests a learning drafter keeps"),
            ("tenants", "Separate statistics (tenants) a learning drafter keeps"),
            ("evicted_requests", "Requests a learning drafter evicted to stay within its bound"))}
        self.learning_drafters: dict = {}  # name -> drafter with memory(), read at render()
        self.prefix = {f: Gauge(p + "prefix_cache_" + f, help_, registry=r) for f, help_ in (
            ("lookups", "Requests that looked up the prefix cache"),
            ("hits", "Requests that adopted a cached prefix"),
            ("hit_rate", "Hits / lookups"),
            ("prompt_tokens", "Prompt tokens of the lookups"),
            ("cached_tokens", "Prompt tokens taken from the prefix cache (not recomputed)"),
            ("token_hit_rate", "Cached tokens / prompt tokens"),
            ("evictions", "Parked entries dropped (budget, a running request, a reallocation)"),
            ("bytes", "KV bytes the parked slots hold"),
            ("entries", "Parked sequences"),
            ("budget_bytes", "The prefix cache's budget"))}
        self.prefix_cache = None  # state/prefix_cache.PrefixCache, read at render()
        # the engine thread's observations of every step and cycle (`engine_step`, `engine_cycle`,
        # `handoff`), folded into the metrics above when /metrics is scraped (`flush`): between two
        # engine steps prometheus_client's labels() lookups and locked counters took ~20 us a step
        # on warm caches and ~150 us on the caches a decode step had just flushed, where appending
        # a record takes ~1 us / ~15 us (docs/serving-performance.md, fifteenth round)
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()
        self._fold_lock = threading.Lock()  # a flush's whole fold: a scrape waits for one in progress
        self._forward_children: dict = {}  # model -> forward_seconds.labels(model)

    # -- the engine thread's observations (deferred) -------------------------------------------
    def _defer(self, record: tuple) -> None:
        with self._pending_lock:
            self._pending.append(record)
            full = len(self._pending) >= PENDING_MAX
        if full:  # nobody scrapes: fold them in here, now and then
            self.flush()

    def pending(self) -> bool:
        """Observations wait to be folded in (`flush`)."""
        return bool(self._pending)

    def engine_cycle(self, s: CycleStats) -> None:
        """Engine.on_cycle hook (engine thread): the cycle's counts (`_cycle_into`) at the next `flush`."""
        self._defer(("cycle", s))

    def engine_step(self, kind: str, rows: int, seconds: float, tokens: int, threads: int, cpu: float,
                    generated: int) -> None:
        """One engine step (AsyncEngine, engine thread), folded in at the next `flush`: its seconds
        (step_seconds), its kind, rows, seconds and tokens if it ran rows (steps_by_kind_*), its
        torch threads, seconds and CPU seconds (steps_by_threads_*, engine_threads) and the
        `generated` tokens handed to requests."""
        self._defer(("step", kind, rows, seconds, tokens, threads, cpu, generated))

    def handoff(self, seconds: float) -> None:
        """A hand-off the engine thread waited `seconds` for (AsyncEngine), at the next `flush`."""
        self._defer(("handoff", seconds))

    def flush(self) -> None:
        """Fold the engine thread's pending observations into the metrics (render() does it first,
        and the engine thread when its queue is full or it has been idle a while): counters
        summed per label set, one inc each; each histogram's values counted into its buckets at
        once (`observe_all`). 4,096 records took 11 ms (plain chain) to 16 ms (router) with a
        histogram observe() each, 6-8 with this (docs/serving-performance.md, sixteenth round).
        One flush at a time (`_fold_lock`): a scrape during the engine thread's idle fold waits for
        it, so it renders every record taken before it (review18)."""
        with self._fold_lock:
            with self._pending_lock:
                items, self._pending = self._pending, []
            if items:
                self._fold(items)

    def _fold(self, items: list) -> None:
        sums: dict[tuple, float] = collections.defaultdict(float)  # (counter, labels) -> amount
        values: dict = collections.defaultdict(list)  # histogram (child) -> observed values
        threads = None
        steps = values[self.step_seconds]
        for rec in items:
            if rec[0] == "step":
                _, kind, rows, seconds, tokens, threads, cpu, generated = rec
                steps.append(seconds)
                t = (str(threads),)
                sums[self.steps_by_threads, t] += 1
                sums[self.steps_by_threads_seconds, t] += seconds
                sums[self.steps_by_threads_cpu, t] += cpu
                if rows:
                    k = (kind, str(rows))
                    sums[self.steps_by_kind, k] += 1
                    sums[self.steps_by_kind_seconds, k] += seconds
                    sums[self.steps_by_kind_tokens, k] += tokens
                sums[self.generated_tokens, ()] += generated
            elif rec[0] == "cycle":
                self._cycle_into(rec[1], sums, values)
            elif rec[0] == "governor":
                sums[self.governor_changes, (rec[1],)] += 1
                threads = rec[2]
            else:
                sums[self.handoffs, ()] += 1
                sums[self.handoff_seconds, ()] += rec[1]
        self._apply(sums, values)
        if threads is not None:
            self.engine_threads.set(threads)

    @staticmethod
    def _apply(sums: dict, values: dict) -> None:
        for (counter, labels), amount in sums.items():
            (counter.labels(*labels) if labels else counter).inc(amount)
        for hist, vs in values.items():
            observe_all(hist, vs)

    def _cycle_into(self, s: CycleStats, sums: dict, values: dict) -> None:
        """One cycle's counters added to `sums`, its histograms' values to `values`."""
        chain = ">".join(s.chain)
        for j in range(1, len(s.chain)):
            pair = (s.chain[j - 1], s.chain[j])
            sums[self.drafted, pair] += s.drafted[j]
            sums[self.accepted, pair] += s.accepted[j]
        sums[self.chain_choices, (chain,)] += s.rows
        sums[self.committed, (chain,)] += s.committed
        k = str(s.k if len(s.chain) > 1 else 0)
        sums[self.plan_cycles, (chain, k)] += s.rows
        sums[self.plan_committed, (chain, k)] += s.committed
        if s.rows:
            values[self.acceptance_length].append(s.committed / s.rows)
        for model, t in s.forward_time.items():
            child = self._forward_children.get(model)
            if child is None:
                child = self._forward_children[model] = self.forward_seconds.labels(model)
            values[child].append(t)
        for model, n in s.forward_tokens.items():
            sums[self.forward_tokens, (model,)] += n

    def observe_governor(self, change: str, threads: int) -> None:
        """TeamGovernor.on_change (engine thread): it dropped to or restored `threads` threads (in
        order with the steps: at the next `flush`)."""
        self._defer(("governor", change, threads))

    def observe_failure(self, failure) -> None:
        """Engine.on_model_failure hook (engine thread)."""
        self.model_failures.labels(failure.model, failure.kind).inc()

    def render(self) -> bytes:
        self.flush()
        for name, drafter in self.learning_drafters.items():
            mem = drafter.memory()
            for f, gauge in self.learned.items():
                gauge.labels(name).set(getattr(mem, f))
        cache = self.prefix_cache
        if cache is not None:
            st = cache.stats
            for f, v in (("lookups", st.lookups), ("hits", st.hits), ("prompt_tokens", st.prompt_tokens),
                         ("cached_tokens", st.cached_tokens), ("evictions", st.evictions),
                         ("hit_rate", st.hits / st.lookups if st.lookups else 0.0),
                         ("token_hit_rate", st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0),
                         ("bytes", cache.parked_bytes), ("entries", len(cache.entries)),
                         ("budget_bytes", cache.budget_bytes)):
                self.prefix[f].set(v)
        return generate_latest(self.registry)
