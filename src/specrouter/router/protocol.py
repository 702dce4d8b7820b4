"""What the engine calls on a router (`RouterProtocol`): plan a step's batch, observe the step,
finish a request, and the two events in between (a confident draft on offer, a model failed).
`policy.Router` is the adaptive one; tests drive the engine with scripted ones that implement
the same five methods. The engine never probes a router for optional members."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from specrouter.records.routing import BatchPlan, Plan, RowContext, StepReport


class RouterProtocol(Protocol):
    # the clock plan_batch reads to time a step's host work outside the executor
    # (router/host_time.py); an Engine running the router sets it to its busy clock
    # (`Engine.busy_clock`: the engine's own time, not its caller's between steps); None: the
    # router times nothing (a scripted router, a simulated pool)
    step_clock: Callable[[], float] | None
    # the executor measures D_TV at verified positions for it (RowOutcome.tv): read at start and
    # again after each plan_batch, for the step it planned (a lease's steps keep it)
    measure_tv: bool
    tv_positions: int  # ... at each row's first this many candidates per level, in sampled rows
    # (a greedy row's D_TV is not measured: the router reads acceptance counts there)

    def plan_batch(self, rows: Sequence[RowContext], pinned: Sequence[Plan] = ()) -> BatchPlan:
        """The plans of a step's rows that the router chooses (`rows`), knowing the plans of
        the rows that pinned theirs (`pinned`), for the batch the step really runs."""
        ...

    def take_confident_drafts(self, rows: Sequence[RowContext], plans: list[Plan],
                              offers: Mapping[int, tuple[str, int, float]],
                              pinned: Sequence[Plan] = ()) -> list[Plan]:
        """`plans` with the rows whose model-free drafter offers a confident draft now
        (`offers[i] = (drafter, m tokens, its expected accepted tokens)`) switched to it where
        the step gains."""
        ...

    def observe_step(self, report: StepReport) -> None:
        """Learn from one committed engine step (called once per step, after its commit)."""
        ...

    def finish_request(self, seq_id: int) -> None:
        """The request ended (finished, aborted or failed): forget it."""
        ...

    def mark_failed(self, model: str) -> None:
        """`model` is out of service: no plan uses it from now on."""
        ...
