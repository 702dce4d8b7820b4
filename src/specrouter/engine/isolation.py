"""Per-row failure isolation: one row's failure never costs the other rows of its batch.

A row can fail while it is prepared (its chain is planned, its sampling tensors are built) or
while a cycle runs over it (an overflow, a distribution that is not one): anything that raises
and is not a `ModelFailure` (a failing model is taken out of the chains instead: faults.py).
Such a failure belongs to a row, not to the batch, so `run_isolated`

1. snapshots what a cycle may change (the rows' committed lengths and every model's cache
   length for them) and runs the batch;
2. if that raises, restores the snapshot (an O(1) rollback per model state: a cycle only
   writes cache positions at or past the committed ones) and runs every row alone;
3. a row that fails alone finishes with finish_reason "error" and the exception in
   `seq.error`; the others commit exactly what they would have committed in any batch
   (greedy: token for token their solo output).

What a committed cycle is reported to (the router's evidence, metrics: `observe`) runs once per
committed run, after it and outside the rollback: a report that raises loses that cycle's
evidence (logged), it never rolls back committed tokens nor makes the rows run (and be counted)
again. The rows' `RequestStats`, counted by the executor as it commits, are part of the snapshot.

The engine calls these per group of rows; a scheduler that forms batches differently calls
them the same way (`snapshot` / `restore` / `fail_row` are the pieces).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from specrouter.records.stats import RequestStats
from specrouter.state.manager import StateManager
from specrouter.state.sequence import Sequence

logger = logging.getLogger("specrouter.engine.isolation")


@dataclass(frozen=True)
class RowSnapshot:
    """What a cycle may change in one row."""

    num_tokens: int  # committed tokens (prompt + generated) before the cycle
    cache_lens: dict[str, int]  # model -> cache_len before the cycle (models not there: 0)
    stats: RequestStats  # a copy of the row's counters before the cycle


def copy_stats(stats: RequestStats) -> RequestStats:
    """An independent copy of a row's counters. Their fields are numbers and dicts of numbers,
    so a copy of each dict is a deep copy (`copy.deepcopy` of the same took ~20 us a row, every
    step of both engines: a third of the plain engine's host work outside the executor at 4
    rows, measured with benchmarks/serve_engine.py --trace); any other mutable field would be
    deep-copied. Built from the instance dict directly: `copy.copy` and a setattr per dict
    took 3.3 us a row against 1.4 (Sapphire Rapids), every step of both engines."""
    fields = dict(vars(stats))
    for name, value in fields.items():
        if isinstance(value, dict):
            fields[name] = dict(value)
        elif not isinstance(value, _IMMUTABLE):
            fields[name] = copy.deepcopy(value)
    out = object.__new__(type(stats))
    vars(out).update(fields)
    return out


_IMMUTABLE = (int, float, str, bool, type(None))


def snapshot(state: StateManager, rows: list[Sequence]) -> list[RowSnapshot]:
    return [RowSnapshot(len(s.tokens), {m: st.cache_len for m, st in state.states_of(s.seq_id).items()},
                        copy_stats(s.stats))
            for s in rows]


def restore(state: StateManager, rows: list[Sequence], snaps: list[RowSnapshot]) -> None:
    """Put the rows back as they were at `snapshot`: committed tokens, done flags and every
    model's cache length (slots a failed cycle allocated stay, empty) and request counters."""
    for seq, snap in zip(rows, snaps):
        del seq.tokens[snap.num_tokens:]
        vars(seq.stats).update(vars(copy_stats(snap.stats)))  # in place: callers hold seq.stats
        seq.done, seq.finish_reason = False, None
        for model, st in state.states_of(seq.seq_id).items():
            state.rollback(st, snap.cache_lens.get(model, 0))


def fail_row(seq: Sequence, error: BaseException) -> None:
    """End one row with finish_reason "error" (its request alone gets the error)."""
    seq.done, seq.finish_reason = True, "error"
    seq.error = f"{type(error).__name__}: {error}"
    logger.error("request %d failed and ends alone: %s", seq.seq_id, seq.error,
                 exc_info=(type(error), error, error.__traceback__))


R = TypeVar("R")


def run_isolated(rows: list[Sequence], run: Callable[[list[Sequence]], R], state: StateManager,
                 observe: Callable[[list[Sequence], R], None] | None = None) -> None:
    """`run(rows)` commits a cycle over the rows; if it raises, roll the rows back and
    `run([row])` for each row alone; rows that fail alone end with `fail_row`. After each run
    that committed, `observe(its rows, its result)` (see the module docstring)."""
    snaps = snapshot(state, rows)
    try:
        result = run(rows)
    except Exception as e:  # noqa: BLE001 - whose failure it is is found out below
        restore(state, rows, snaps)
        if len(rows) == 1:
            fail_row(rows[0], e)
            return
        logger.warning("a cycle over %d rows raised (%s: %s); running each row alone",
                       len(rows), type(e).__name__, e)
    else:
        _report(observe, rows, result)
        return
    for seq, snap in zip(rows, snaps):
        try:
            result = run([seq])
        except Exception as e:  # noqa: BLE001 - this row's own failure
            restore(state, [seq], [snap])
            fail_row(seq, e)
        else:
            _report(observe, [seq], result)


def _report(observe: Callable[[list[Sequence], R], None] | None, rows: list[Sequence], result: R) -> None:
    """`observe(rows, result)` for a committed run; a failure there is logged, not retried."""
    if observe is None:
        return
    try:
        observe(rows, result)
    except Exception:  # noqa: BLE001 - the tokens are committed: only this cycle's evidence is lost
        logger.exception("reporting a committed cycle over %d row(s) raised; its evidence is lost, "
                         "its tokens stand", len(rows))
