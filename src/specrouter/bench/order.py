"""The order in which a scenario's systems decode request i (bench/run.py `run_scenario`).

Every system in turn, the order rotated by one per request, so no system always runs first. The
floor ratio (SpecRouter / target-only, issue 28) also has its two systems side by side: the
machine drifts over the seconds a request's ~20 systems take (co-tenants on the 2 shared cores),
and on a row of 2 requests of 64 tokens the rotation does not average that out. floor25 measured
it on the chat t=0.7 row (11 runs, static systems, whose tokens are the same every run): two
systems run next to each other deviate from each other by 6.8% rms per request, 8 or more apart
by 13.3% (docs/benchmarks.md "floor25"). So target-only runs next to SpecRouter: right after it
on even requests, right before it on odd ones (neither always runs first of the two); every
other system keeps its rotated place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

S = TypeVar("S")


def run_order(systems: Sequence[S], i: int, pair: tuple[S, S] | None = None) -> list[S]:
    """Request i's order: `systems` rotated by i; with `pair` = (a, b), both in `systems`, b is
    moved next to a (after it for even i, before it for odd i)."""
    if i < 0:
        raise ValueError(f"request index must be >= 0, got {i}")
    n = len(systems)
    order = [systems[(i + j) % n] for j in range(n)] if n else []
    if pair is None:
        return order
    a, b = pair
    if a is b or a not in order or b not in order:
        raise ValueError("run_order's pair must be two distinct systems of the list")
    order.remove(b)
    at = order.index(a)
    order.insert(at + 1 if i % 2 == 0 else at, b)
    return order
