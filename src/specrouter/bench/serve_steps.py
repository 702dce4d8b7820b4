"""Where a paired run's time goes (`specrouter bench --serve`'s library table, issue 34): the engine
steps of each side and what is outside them.

A server request's wall time (the client's, send to last byte) and a library call's both contain
the engine's steps; what is left is the rest of the path: for the server HTTP, tokenizing, the
per-step hand-offs to the event loop and the client's own CPU on the same cores, for the library
its Python around the steps. Each side's steps are counted and timed the same way, around
`Engine.step()`: the library's by wrapping its engine's `step` (`StepClock`), the server's from
its own histogram `specrouter_step_seconds` on /metrics (`server_steps`, read before and after,
outside the timed region). So a ratio below 1 splits into "the steps are slower" (the same
number of steps, more seconds each) and "more time outside the steps".

Why a router server loses to the plain one (issue 26): `StepKinds` reads a server's steps by
kind and batch size (held plain, planned plain, speculative: their count, seconds and tokens)
and its row-cycles by chain and draft length (with the tokens they committed) from /metrics
(server/metrics.py), before and after a level; `kinds_summary` puts the difference in the
bench's JSON and summary.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field



@dataclass
class Steps:
    """Engine steps over a span: how many and their summed wall seconds."""

    count: int = 0
    seconds: float = 0.0

    def __add__(self, other: "Steps") -> "Steps":
        return Steps(self.count + other.count, self.seconds + other.seconds)

    def __sub__(self, other: "Steps") -> "Steps":
        return Steps(self.count - other.count, self.seconds - other.seconds)


class StepClock:
    """Times every `engine.step()` of an in-process engine (an instance attribute wraps it;
    `close` restores it). `steps` is the running total."""

    def __init__(self, engine):
        self.engine, self.steps = engine, Steps()
        inner = engine.step

        def timed_step():
            t0 = time.perf_counter()
            try:
                return inner()
            finally:
                self.steps = Steps(self.steps.count + 1, self.steps.seconds + time.perf_counter() - t0)

        engine.step = timed_step

    def close(self) -> None:
        self.engine.__dict__.pop("step", None)


def metrics_text(base_url: str, api_key: str | None = None) -> str:
    """A server's /metrics page; `base_url` is the server's ".../v1" URL."""
    root = base_url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(root + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def samples(text: str):
    """The samples of a /metrics page (prometheus_client's own parser of the text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        yield from family.samples


def histogram_in(text: str, name: str) -> Steps:
    """A seconds histogram of a /metrics page (`specrouter_<name>`, no labels): its count and summed
    seconds."""
    got = {x.name: x.value for x in samples(text) if x.name in (f"specrouter_{name}_sum", f"specrouter_{name}_count")}
    if len(got) != 2:
        raise ValueError(f"no specrouter_{name} histogram on the /metrics page")
    return Steps(int(got[f"specrouter_{name}_count"]), got[f"specrouter_{name}_sum"])


def server_histogram(base_url: str, name: str, api_key: str | None = None) -> Steps:
    """A seconds histogram of the server's /metrics so far (`histogram_in`); `base_url` is the
    server's ".../v1" URL."""
    return histogram_in(metrics_text(base_url, api_key), name)


def server_steps(base_url: str, api_key: str | None = None) -> Steps:
    """The server's engine steps so far (its `specrouter_step_seconds` histogram on /metrics)."""
    return server_histogram(base_url, "step_seconds", api_key)


def split(wall: float, steps: Steps, units: int) -> dict:
    """A side's wall time split per unit (request at c=1, level at c >= 4): mean step (ms), steps
    and ms outside the steps per unit."""
    return {"step_ms": steps.seconds / steps.count * 1e3 if steps.count else None,
            "steps": steps.count / units if units else None,
            "outside_ms": (wall - steps.seconds) / units * 1e3 if units else None}


def at_library_step(library: dict, side: dict) -> float | None:
    """A server side / the library (per unit, `split` dicts of a paired run) with the side's steps
    timed at the library's mean step: the library's ms per unit over (library step ms x the side's
    steps + the side's ms outside the steps). On this project's VM a step's speed moves between
    processes and minutes by itself, +-10-25% (docs/serving-performance.md, ninth round), not with
    the server's code; this ratio charges the server only what it adds: more steps, and time
    outside them (HTTP, tokenizing, hand-offs). It reads the server where every side takes the same
    steps (the plain chain); the router's sides choose their own chains, so their mean steps differ
    by more than the machine. None where a figure is missing."""
    need = (library.get("step_ms"), library.get("steps"), library.get("outside_ms"), side.get("steps"),
            side.get("outside_ms"))
    if any(v is None for v in need):
        return None
    step, steps, outside, side_steps, side_outside = need
    return (step * steps + outside) / (step * side_steps + side_outside)


@dataclass
class ThreadSteps:
    """A server's engine steps by the torch threads they ran on, threads -> [steps, wall seconds, the
    engine thread's CPU seconds], and `TeamGovernor`'s changes, "drop" / "restore" -> count (its
    /metrics, server/metrics.py); subtract two readings for a span."""

    steps: dict = field(default_factory=dict)
    changes: dict = field(default_factory=dict)

    @staticmethod
    def parse(text: str) -> "ThreadSteps":
        out = ThreadSteps()
        slot = {"specrouter_steps_by_threads_total": 0, "specrouter_steps_by_threads_seconds_total": 1,
                "specrouter_steps_by_threads_cpu_seconds_total": 2}
        for sample in samples(text):
            if sample.name in slot:
                out.steps.setdefault(int(sample.labels["threads"]), [0.0] * 3)[slot[sample.name]] = sample.value
            elif sample.name == "specrouter_governor_changes_total":
                out.changes[sample.labels["change"]] = sample.value
        return out

    def __sub__(self, other: "ThreadSteps") -> "ThreadSteps":
        steps = {n: [x - y for x, y in zip(v, other.steps.get(n, [0.0] * 3))] for n, v in self.steps.items()}
        return ThreadSteps(steps, {c: v - other.changes.get(c, 0.0) for c, v in self.changes.items()})

    def __add__(self, other: "ThreadSteps") -> "ThreadSteps":
        steps = {n: list(v) for n, v in self.steps.items()}
        for n, v in other.steps.items():
            steps[n] = [x + y for x, y in zip(steps.get(n, [0.0] * 3), v)]
        changes = dict(self.changes)
        for c, v in other.changes.items():
            changes[c] = changes.get(c, 0.0) + v
        return ThreadSteps(steps, changes)

    def summary(self) -> dict:
        """JSON-ready: the share of steps (and of step seconds) below the team's count (the largest the
        server ran on: a span keeps every count of its readings, stepped on or not), the
        engine thread's CPU share of its step seconds (what the governor reads), drops, restores."""
        if not any(v[0] for v in self.steps.values()):
            return {"reduced_steps": None, "reduced_seconds": None, "cpu_share": None,
                    "drops": int(self.changes.get("drop", 0)), "restores": int(self.changes.get("restore", 0))}
        top = max(self.steps)
        total = [sum(v[i] for v in self.steps.values()) for i in range(3)]
        reduced = [sum(v[i] for n, v in self.steps.items() if n < top) for i in range(2)]
        return {"threads": top, "reduced_steps": reduced[0] / total[0],
                "reduced_seconds": reduced[1] / total[1] if total[1] > 0 else None,
                "cpu_share": total[2] / total[1] if total[1] > 0 else None,
                "drops": int(self.changes.get("drop", 0)), "restores": int(self.changes.get("restore", 0))}


@dataclass
class StepKinds:
    """A server's counters of steps by (kind, rows) -> [steps, seconds, tokens] and row-cycles by
    (chain, k) -> [cycles, committed tokens] (server/metrics.py); subtract two readings for a span."""

    steps: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)

    @staticmethod
    def parse(text: str) -> "StepKinds":
        out = StepKinds()
        slot = {"steps_by_kind": 0, "steps_by_kind_seconds": 1, "steps_by_kind_tokens": 2,
                "plan_cycles": 0, "plan_committed_tokens": 1}
        for x in samples(text):
            name = x.name.removeprefix("specrouter_").removesuffix("_total")
            if not x.name.endswith("_total") or name not in slot:
                continue
            labels, value = x.labels, x.value
            if name.startswith("steps_by_kind"):
                key, table, width = (labels["kind"], int(labels["rows"])), out.steps, 3
            else:
                key, table, width = (labels["chain"], int(labels["k"])), out.plans, 2
            table.setdefault(key, [0.0] * width)[slot[name]] = value
        return out

    @staticmethod
    def read(base_url: str, api_key: str | None = None) -> "StepKinds":
        return StepKinds.parse(metrics_text(base_url, api_key))

    def __sub__(self, other: "StepKinds") -> "StepKinds":
        def sub(a: dict, b: dict) -> dict:
            out = {}
            for key, v in a.items():
                d = [x - y for x, y in zip(v, b.get(key, [0.0] * len(v)))]
                if d[0] > 0:
                    out[key] = d
            return out
        return StepKinds(sub(self.steps, other.steps), sub(self.plans, other.plans))

    def __add__(self, other: "StepKinds") -> "StepKinds":
        def add(a: dict, b: dict) -> dict:
            out = {key: list(v) for key, v in a.items()}
            for key, v in b.items():
                out[key] = [x + y for x, y in zip(out.get(key, [0.0] * len(v)), v)]
            return out
        return StepKinds(add(self.steps, other.steps), add(self.plans, other.plans))


def kinds_summary(kinds: StepKinds) -> dict:
    """JSON-ready: per step kind (all batch sizes) and per (kind, rows), the steps, their share,
    mean ms, tokens per step and tokens per second of step time; per (chain, k) the row-cycles
    and mean tokens committed per row-cycle (the acceptance length of that plan)."""
    total = sum(v[0] for v in kinds.steps.values()) or 1.0

    def row(steps: float, seconds: float, tokens: float) -> dict:
        return {"steps": int(steps), "share": steps / total, "step_ms": seconds / steps * 1e3 if steps else None,
                "tokens_per_step": tokens / steps if steps else None,
                "step_tokens_per_s": tokens / seconds if seconds > 0 else None}

    by_kind: dict[str, list[float]] = {}
    for (kind, _), v in kinds.steps.items():
        acc = by_kind.setdefault(kind, [0.0, 0.0, 0.0])
        for i in range(3):
            acc[i] += v[i]
    return {"kinds": {kind: row(*v) for kind, v in sorted(by_kind.items())},
            "kinds_by_rows": [{"kind": kind, "rows": n, **row(*v)} for (kind, n), v in sorted(kinds.steps.items())],
            "plans": [{"chain": chain, "k": k, "cycles": int(v[0]), "tokens_per_cycle": v[1] / v[0] if v[0] else None}
                      for (chain, k), v in sorted(kinds.plans.items())]}


def kinds_markdown(rows: list[dict]) -> list[str]:
    """serve.md's "why" tables from the bench's rows (their `router_steps` / `plain_steps`,
    `kinds_summary`): each server's steps by kind, the router's row-cycles by plan; [] without."""
    if not any(r.get("router_steps") for r in rows):
        return []

    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    steps, plans = [], []
    for r in rows:
        at = f"| {r['temperature']} | {r['concurrency']} |"
        for name in ("router", "plain"):
            for kind, x in (r.get(f"{name}_steps") or {}).get("kinds", {}).items():
                steps.append(f"{at} {name} | {kind} | {x['steps']} ({x['share'] * 100:.0f}%) | {f(x['step_ms'], 2)} | "
                             f"{f(x['tokens_per_step'], 2)} | {f(x['step_tokens_per_s'])} |")
        plans += [f"{at} {x['chain']} | {x['k']} | {x['cycles']} | {f(x['tokens_per_cycle'], 2)} |"
                  for x in (r.get("router_steps") or {}).get("plans", [])]
    return ["", "Why (each server's engine steps over the level, from its /metrics: held = plain under the "
                "router's hold (the step starting it included), plain = planned plain without a hold or no router, "
                "spec = some row drafted; tok/s = tokens over the steps' own seconds):", "",
            "| t | c | server | kind | steps (share) | step ms | tokens / step | tok/s of steps |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |", *steps,
            "", "The router server's row-cycles by plan (chain, draft length k) and the tokens each committed "
                "(acceptance length, bonus included):", "",
            "| t | c | chain | k | row-cycles | tokens / row-cycle |", "| --- | --- | --- | --- | --- | --- |", *plans]
