"""A model draft caught up on a row's committed tokens for its evidence (router/catch_up.py has
the why and the rule): the executor's side. The draft is fed the tokens it has not seen in one
forward per model, with logits at every position whose next token the row generated; the token
it samples at each (greedy: argmax; sampled: the position-keyed noise every level shares, so
exactly what it would have drafted there) is compared with the committed one once the cycle
commits. Only the draft's cache moves (to the row's committed tokens, as any catch-up); the
row's output is the target's."""

from __future__ import annotations

from specrouter.decoding.processors import RowHistory, process_rows
from specrouter.decoding.sampling import SamplingTensors
from specrouter.models.runners.base import ForwardBatch


MAX_SCORED = 64  # positions a catch-up scores at most (its logits: MAX_SCORED x vocabulary floats)


def catch_up_drafts(ex, work: list, catch_up: list[tuple[str, ...]], sampling: SamplingTensors) -> None:
    """The executor `ex`'s rows `work` (its RowWork): each model draft a row catches up
    (router/catch_up.py) fed the row's committed tokens it has not seen, in ONE forward per
    model over its rows, with logits at every position
    whose next token the row generated; the token the draft samples there (as it would have
    drafted it: greedy argmax, or the position-keyed noise every level shares) is kept in
    `w.caught` and scored against the committed one when the cycle commits (`caught_up_trials`).
    A row's logits processors (penalties, logit_bias, min_tokens) process each position with the
    committed tokens before it as its history, as the draft's own draft path would have had them
    there. Rows whose chain runs the model, rows with a grammar (its state at a past position is
    not kept), and rows past the model's cache are left out."""
    by_model: dict[str, list] = {}
    for w, models in zip(work, catch_up):
        if w.seq.grammar is not None:
            continue
        for m in models:
            if m in ex.runners and m not in ex.heads and m not in w.chain and ex.runners[m].max_len >= w.start:
                by_model.setdefault(m, []).append(w)
    for name in [m for m in ex.order if m in by_model]:
        rows = by_model[name]
        slots, starts, feeds, positions, offsets, histories = [], [], [], [], [], []
        for w in rows:
            st = ex.state.state(w.seq.seq_id, name)
            c = st.cache_len
            pending = w.seq.tokens[c:]  # (start - c) tokens: the logits at index i sample position c + i + 1
            # from the first position the row generated, its last MAX_SCORED at most
            first = max(0, w.seq.prompt_len - 1 - c, len(pending) - MAX_SCORED)
            slots.append(st.slot)
            starts.append(c)
            feeds.append(pending)
            positions.append(list(range(first, len(pending))))
            offsets.append([c + i + 1 - w.start for i in positions[-1]])
            p0 = c + first + 1  # the first position sampled: its history is the tokens before it
            histories.append((w, p0) if w.processors else None)
            ex.state.fed(st, w.seq.tokens, [])
        batch = ForwardBatch.build(slots, starts, feeds, positions)
        logits = ex._timed_forward(name, batch, len(rows), ex._width(name, batch, len(rows)),
                                   sum(starts) // len(starts))  # (B, G, V)
        G = logits.shape[1]
        if any(h is not None for h in histories):  # (timed as the step's processors)
            t0 = ex.clock()
            logits = process_rows(logits if logits.device.type == "cpu" else logits.cpu(),
                                  [None if h is None else past_history(*h, G) for h in histories]).to(logits.device)
            ex._proc_seconds += ex.clock() - t0
            ex._proc_rows += sum(h is not None for h in histories)
        padded = [o + [o[-1]] * (G - len(o)) for o in offsets]
        tokens = ex._sample(logits, rows, sampling, offsets=padded).tolist()  # (B, G)
        for w, o, t in zip(rows, offsets, tokens):
            w.caught.append((name, [w.start + x for x in o], t[: len(o)]))


def past_history(w, p0: int, G: int) -> RowHistory:
    """The processors' history of row w's logits at positions p0 .. p0 + G - 1 (decoding/
    processors.py `RowHistory`): the committed tokens before p0, then the committed ones after
    it as the path (a padded position past the row's own reads its last token again)."""
    path = w.seq.tokens[p0 : w.start]
    path = path + (path or w.seq.tokens[:p0])[-1:] * max(0, G - 1 - len(path))
    return RowHistory(w.seq.params, w.seq.tokens[:p0], w.seq.prompt_len, w.seq.stop_ids, path, 0)


def caught_up_trials(caught: list[tuple[str, list[int], list[int]]], tokens: list[int]
                     ) -> tuple[tuple[str, int, int], ...]:
    """(model, matches, trials) of each caught-up draft (`catch_up_drafts`): its token at
    each position the row has committed against the committed one."""
    out = []
    for name, positions, drafted in caught:
        trials = [(p, t) for p, t in zip(positions, drafted) if p < len(tokens)]
        out.append((name, sum(tokens[p] == t for p, t in trials), len(trials)))
    return tuple(out)
