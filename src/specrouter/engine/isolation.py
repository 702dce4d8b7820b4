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

The engine calls these per group of rows; a scheduler that forms batches differently calls
them the same way (`snapshot` / `restore` / `fail_row` are the pieces).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from specrouter.state.manager import StateManager
from specrouter.state.sequence import Sequence

logger = logging.getLogger("specrouter.engine.isolation")


@dataclass(frozen=True)
class RowSnapshot:
    """What a cycle may change in one row."""

    num_tokens: int  # committed tokens (prompt + generated) before the cycle
    cache_lens: dict[str, int]  # model -> cache_len before the cycle (models not there: 0)


def snapshot(state: StateManager, rows: list[Sequence]) -> list[RowSnapshot]:
    return [RowSnapshot(len(s.tokens), {m: st.cache_len for m, st in state.states_of(s.seq_id).items()})
            for s in rows]


def restore(state: StateManager, rows: list[Sequence], snaps: list[RowSnapshot]) -> None:
    """Put the rows back as they were at `snapshot`: committed tokens, done flags and every
    model's cache length (slots a failed cycle allocated stay, empty)."""
    for seq, snap in zip(rows, snaps):
        del seq.tokens[snap.num_tokens:]
        seq.done, seq.finish_reason = False, None
        for model, st in state.states_of(seq.seq_id).items():
            st.cache_len = min(st.cache_len, snap.cache_lens.get(model, 0))
            st.speculative = []


def fail_row(seq: Sequence, error: BaseException) -> None:
    """End one row with finish_reason "error" (its request alone gets the error)."""
    seq.done, seq.finish_reason = True, "error"
    seq.error = f"{type(error).__name__}: {error}"
    logger.error("request %d failed and ends alone: %s", seq.seq_id, seq.error,
                 exc_info=(type(error), error, error.__traceback__))


def run_isolated(rows: list[Sequence], run: Callable[[list[Sequence]], object],
                 state: StateManager) -> None:
    """`run(rows)`; if it raises, roll the rows back and `run([row])` for each row alone; rows
    that fail alone end with `fail_row` (see the module docstring)."""
    snaps = snapshot(state, rows)
    try:
        run(rows)
        return
    except Exception as e:  # noqa: BLE001 - whose failure it is is found out below
        restore(state, rows, snaps)
        if len(rows) == 1:
            fail_row(rows[0], e)
            return
        logger.warning("a cycle over %d rows raised (%s: %s); running each row alone",
                       len(rows), type(e).__name__, e)
    for seq, snap in zip(rows, snaps):
        try:
            run([seq])
        except Exception as e:  # noqa: BLE001 - this row's own failure
            restore(state, [seq], [snap])
            fail_row(seq, e)
