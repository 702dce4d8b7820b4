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
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass

_STEP_SUM = re.compile(r"^specrouter_step_seconds_sum(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
_STEP_COUNT = re.compile(r"^specrouter_step_seconds_count(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


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


def server_steps(base_url: str, api_key: str | None = None) -> Steps:
    """The server's engine steps so far (its `specrouter_step_seconds` histogram on /metrics);
    `base_url` is the server's ".../v1" URL."""
    root = base_url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(root + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    total, count = _STEP_SUM.search(text), _STEP_COUNT.search(text)
    if total is None or count is None:
        raise ValueError(f"no specrouter_step_seconds histogram on {root}/metrics")
    return Steps(int(float(count.group(1))), float(total.group(1)))


def split(wall: float, steps: Steps, units: int) -> dict:
    """A side's wall time split per unit (request at c=1, level at c >= 4): mean step (ms), steps
    and ms outside the steps per unit."""
    return {"step_ms": steps.seconds / steps.count * 1e3 if steps.count else None,
            "steps": steps.count / units if units else None,
            "outside_ms": (wall - steps.seconds) / units * 1e3 if units else None}
