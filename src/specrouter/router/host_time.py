"""An engine step's host seconds outside the executor, measured for the router's cost model.

The executor times its own step (`StepReport.wall_time`: forwards and its host work); the rest
of an engine step is the router's planning and observing, the tree policy's shapes, shadow
proposals and their judging, the engine's bookkeeping. On the 2-core Zen 4 that was ~1.4 ms of
a ~13 ms speculative step on the mixed stream, which static chains do not pay, and only
decide()'s share of it was charged, so plans were predicted faster than they ran.

`OutsideClock` measures it from one `plan_batch` to the next: that period minus the executor's
wall time of the step planned in between. Only between consecutive steps of the same rows (a
request joining or leaving, or the time between requests, is not a step's) and at most the
executor's wall (a stall is not the step's either)."""

from __future__ import annotations

from collections.abc import Sequence


class OutsideClock:
    """Pairs each plan_batch call with the step it planned (module docstring)."""

    def __init__(self):
        # the last planning: (its start, observed steps then, its rows' ids and pinned count,
        # the executor's wall time of its step once observed, whether that step speculated)
        self._last: tuple | None = None

    def planning(self, now: float, steps: int, rows: Sequence, pinned: Sequence = ()) -> tuple[float, bool] | None:
        """A step is being planned at `now` (observed steps so far: `steps`); returns (host
        seconds outside the executor, speculative) of the step planned last, when measurable."""
        ids = (tuple(r.seq_id for r in rows), len(pinned))
        last, self._last = self._last, (now, steps, ids, None, False)
        if last is None or last[3] is None or last[1] + 1 != steps or last[2] != ids:
            return None
        start, _, _, wall, speculative = last
        return min(max(now - start - wall, 0.0), wall), speculative

    def observed(self, steps: int, wall_time: float, speculative: bool) -> None:
        """The step planned last was observed (before the router counts it: `steps` as then)."""
        if self._last is not None and self._last[1] == steps:
            self._last = (*self._last[:3], wall_time, speculative)
