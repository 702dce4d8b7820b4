"""An engine step's host seconds outside the executor, measured for the router's cost model.

The executor times its own step (`StepReport.wall_time`: forwards and its host work); the rest
of an engine step is the router's planning and observing, the tree policy's shapes, shadow
proposals and their judging, the engine's bookkeeping. On the 2-core Zen 4 that was ~1.4 ms of
a ~13 ms speculative step on the mixed stream, which static chains do not pay, and only
decide()'s share of it was charged, so plans were predicted faster than they ran.

`OutsideClock` measures it from one `plan_batch` to the next: that period minus the executor's
wall time of the step planned in between. Only between consecutive steps of the same rows (a
request joining or leaving, or the time between requests, is not a step's), not over a step that
prefilled or caught a model up (`records.routing.widened`), and at most the executor's wall (a
stall is not the step's either). Its clock is the engine's busy clock (`Engine.busy_clock`: the
engine's time inside `Engine.step`), so the period counts the engine's own work only: what a
caller does between steps (a server handing a step's tokens to its event loop and waiting for
it, 0.6-1.7 ms a step on a 2-core Zen 1, and the GIL the loop holds meanwhile) is not a step's
cost the router can trade, and counted, it made a server's router price speculation unlike the
library's on the same requests (docs/serving-performance.md, eleventh round). It tells whether the step was planned by a
hold (batch.py `PlainHold`: no decide) or decided: a settled plain single stream is held, so
its held steps are what plain decoding costs it, while a decided plain step pays decide() as a
speculative one does (on the Zen 1: ~0.8 ms held against ~4.6 ms decided).

`PlainCharge` charges what it measured where a decision weighs plain decoding against
speculation (policy.py, steps 1-3), leaving the order of speculative plans as decide() prices it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Planning:
    """The last plan_batch call (`OutsideClock`) and the steps observed on its plan since."""

    start: float  # its clock
    steps: int  # the router's observed steps then
    ids: tuple  # its rows' seq_ids and pinned count
    wall: float = 0.0  # the executor's wall time of the steps observed since (its step, then a lease's)
    count: int = 0  # ... how many
    speculative: bool = False  # ... whether one speculated
    held: bool = False  # a hold planned it, without deciding


class OutsideClock:
    """Pairs each plan_batch call with the step it planned (module docstring)."""

    def __init__(self):
        self._last: Planning | None = None

    def planning(self, now: float, steps: int, rows: Sequence, pinned: Sequence = ()) -> tuple[float, bool, bool] | None:
        """A step is being planned at `now` (observed steps so far: `steps`); returns (host
        seconds outside the executor, speculative, held) of the step planned last, when
        measurable. The steps the engine ran on that plan's lease (`BatchPlan.steps`, a held
        plain batch's or stream's) are measured with it: the period's
        seconds outside the executor per step (at most the steps' mean wall)."""
        ids = (tuple(r.seq_id for r in rows), len(pinned))
        last, self._last = self._last, Planning(now, steps, ids)
        if last is None or not last.count or last.steps + last.count != steps or last.ids != ids:
            return None
        wall, count = last.wall, last.count
        return min(max((now - last.start - wall) / count, 0.0), wall / count), last.speculative, last.held

    def held(self) -> None:
        """The step being planned was planned by a hold, without deciding."""
        if self._last is not None:
            self._last.held = True

    def observed(self, steps: int, wall_time: float, speculative: bool, widened: bool = False) -> None:
        """The step planned last, or the next step of its lease, was observed (before the router
        counts it: `steps` as then). A `widened` step (records/routing.py: it prefilled a prompt
        or caught a model up) is not measured: its host work outside the executor (the drafters
        indexing the prompt, a server's first chunk of a response) grows with the prompt, not
        per cycle, and a cold first step of a process (a warm-up's prefill) once seeded the EMA
        at 2-10x a cycle's."""
        last = self._last
        if last is not None and last.steps + last.count == steps:
            if widened:
                self._last = None
            else:
                last.wall += wall_time
                last.count += 1
                last.speculative = last.speculative or speculative


@dataclass(frozen=True)
class PlainCharge:
    """The host seconds per cycle outside the executor that a PlanTable leaves out, charged where
    a decision weighs plain decoding against speculation, and only there (always, since lead23
    removed its off switch `charge_leaving_plain`, issue 27).

    The table charges every plan decide()'s seconds per cycle; an engine step really pays its
    kind's measured outside seconds (`OutsideClock`: ~1 ms per speculative step, planning,
    observing and shadow proposals; far less per held plain step). Uncharged, a draft agreeing
    on 10-18% of chat tokens looked ~1% faster than plain decoding and ran ~8% slower. Charged
    everywhere (`charge_outside`, off, removed by prune22), the per-cycle seconds also reordered
    the speculative plans among themselves (longer drafts look cheaper), which lost 2-5% on the
    mixed stream; here the speculative argmin stays the table's."""

    spec: float = 0.0  # seconds per speculative cycle (outside_spec - what the table charges)
    plain: float = 0.0  # seconds per plain cycle (outside_plain - what the table charges)

    @classmethod
    def measured(cls, times: Mapping[str, float], charged: float) -> "PlainCharge":
        """From the published times ("outside_spec", "outside_plain": 0.0 until measured, e.g.
        never in a simulated pool) and the seconds per cycle the table already charges. Plain
        decoding's are a held step's (`OutsideClock`): where speculative steps are measured but
        no held plain step yet (a cold router speculating from its first step), plain decoding
        is charged none of decide()'s seconds, which its held steps do not pay: the safe default
        is not priced at the cost of a step that decides. A speculative cycle's are its held
        steps' ("outside_spec_held", floor21) once measured, every speculative step's before."""
        if times.get("outside_spec_held", 0.0) > 0.0:
            times = {**times, "outside_spec": times["outside_spec_held"]}
        spec = times["outside_spec"] - charged if times["outside_spec"] > 0.0 else 0.0
        if times["outside_plain"] > 0.0:
            return cls(spec, times["outside_plain"] - charged)
        return cls(spec, -charged if times["outside_spec"] > 0.0 else 0.0)

    @property
    def nonzero(self) -> bool:
        """Whether either kind carries host seconds (none measured: the table decides alone)."""
        return self.spec != 0.0 or self.plain != 0.0

    def t_eff(self, table) -> np.ndarray:
        """(C, K) T_eff of every cell of a PlanTable with its kind's charge: row 0 (plain
        decoding, one token per cycle) + `plain`, a speculative cell + `spec` / its expected
        tokens; +inf where the table has none (pruned chains)."""
        t = table.t_eff  # (C, K)
        with np.errstate(invalid="ignore"):
            charged = np.where(np.isfinite(t), t + self.spec / table.expected_tokens, np.inf)  # (C, K)
        charged[0] = t[0] + self.plain
        return charged

    def best(self, table, k_cap: int, charged: np.ndarray | None = None) -> tuple[int, int]:
        """Cell (i, j) of the plan to run with k <= k_cap: the least T_eff among speculative
        plans as the table has it (first minimum: earlier chain, smaller k), unless plain
        decoding is as fast or faster once both carry their charge (`charged`: `t_eff(table)`,
        when the caller keeps it). With no charge this is the table's own argmin (ties to plain
        decoding)."""
        t = table.t_eff[:, :k_cap]  # (C, k_cap)
        if t.shape[0] < 2:
            return 0, 0
        i, j = np.unravel_index(int(np.argmin(t[1:])), t[1:].shape)
        i, j = int(i) + 1, int(j)
        if not math.isfinite(float(t[i, j])):
            return 0, 0
        charged = self.t_eff(table) if charged is None else charged
        if charged[0, 0] <= charged[i, j]:
            return 0, 0
        return i, j
