"""Paired ratios on a drifting machine (`specrouter bench --serve`'s library table, issue 34).

The bench runs each unit (a request at c=1, a round of the batch at c >= 4) on every side back to
back, in rotating order, so the two halves of a pair ran in the same seconds. A pooled ratio (all
tokens over all wall time, per side) lets one unit's stall decide the figure: a co-tenant that
took a core for 12 s during one library request (5.1 tok/s against ~40 for its neighbours,
docs/serving-performance.md, eighth round) made the pooled server / library ratio 1.45x while
the pairs' median was 0.96-1.01x. So every ratio of the table is also given as the median of
its units' paired ratios, with their range: a spread far from the median says the machine moved
during the run, not that a side is slower.
"""

from __future__ import annotations

import statistics


def paired(numer: list[float], denom: list[float]) -> dict | None:
    """The ratios numer[u] / denom[u] of units run side by side: their median, lowest, highest and
    count; None when there is no pair (a side that did not run, or a rate of 0)."""
    ratios = [a / b for a, b in zip(numer, denom) if a and b]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "n": len(ratios)}


def describe(p: dict | None) -> str:
    """'0.97x (0.91-1.02, 8 pairs)', or '-'."""
    return "-" if p is None else f"{p['median']:.2f}x ({p['lo']:.2f}-{p['hi']:.2f}, {p['n']} pairs)"
