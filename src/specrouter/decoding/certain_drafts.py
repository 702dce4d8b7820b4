"""Grammar-forced tokens as certain drafts (issue 30 item 2; decoding/grammar.py).

Where a constrained row's grammar allows exactly one token after a draft path, every level's
masked distribution is one-hot there (the mask is applied at every level along the same path),
so every level accepts that token, greedy or sampled: it is a draft whose acceptance is
certain. The executor appends such tokens to a row's candidates without any model proposing
them, and drafting continues after them:
- a model-free drafter's proposal (cut at its first token the grammar refuses) is followed by
  the forced tokens, then the drafter is asked again after them (up to FREE_ROUNDS times) for
  what remains of its k;
- a model drafter's token is followed by the forced tokens; its next one-token step feeds them
  together with that token (one forward: no draft step is spent on a forced token), so a draft
  of k tokens of its own can span several JSON values;
- a verifier below the target passes up its accepted tokens, its recovered/bonus token and the
  tokens forced after it, so the target's bonus token falls after them (where the model
  chooses) rather than on a forced token.
The draft length k counts the drafter's own tokens; the forced ones ride free, up to the row's
cap (remaining - 1 and the context). The router's evidence counts own tokens only
(`own_counts`): a forced token is neither a trial of a drafter's acceptance nor of its hit
rate; `RowOutcome.certain` reports how many the target committed, and the router's cost model
counts them with acceptance 1 (router/cost_model.py `with_certain`).

Exact by construction: a certain candidate is verified like any other (the target's own token
there is the forced token, so it is accepted); what it changes is how much a cycle commits.
`ChainExecutor.certain_drafts = False` turns it off (Engine.jump_forward sets it too);
`ChainExecutor.certain_counts` totals what the verifying levels did with certain candidates.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass

FREE_ROUNDS = 2  # a model-free drafter is asked again after forced tokens at most this often
FIELD_ROUNDS = 8  # ... with field drafts (one a field: a draft may span this many)


def forcing(seq) -> bool:
    """Whether a row's candidates are extended by its grammar's forced tokens: a constrained row
    without allowed_token_ids (whose own mask could refuse the forced token)."""
    return seq.grammar is not None and seq.params.allowed_token_ids is None


def extend(w) -> int:
    """Append the tokens the grammar forces after `w.cand` (up to the row's cap) to `w.cand`,
    recording their positions in `w.forced`; returns how many."""
    room = w.cap - len(w.cand)
    if room <= 0:
        return 0
    forced = w.seq.grammar.forced_tokens(w.seq.output_ids, room, w.cand)
    if forced:
        w.forced.extend(range(len(w.cand), len(w.cand) + len(forced)))
        w.cand.extend(forced)
    return len(forced)


def propose_after_forced(drafter, w, fields: bool = False) -> None:
    """A model-free draft (`w.cand`) followed by the tokens its grammar forces, and the drafter
    asked again after them for what remains of k, FREE_ROUNDS times at most; with `fields`, the
    field draft replaces each answer where they differ (`preferred`) and the rounds go on
    while field drafts come (FIELD_ROUNDS at most: one draft spans several fields)."""
    sized = drafter.sized_by_confidence and w.min_confidence
    rounds = FIELD_ROUNDS if fields and w.seq.grammar.fields is not None else FREE_ROUNDS
    for r in range(rounds + 1):
        if not extend(w) or r == rounds:
            return
        own = own_count(w, len(w.cand))
        if own >= w.k or len(w.cand) >= w.cap:
            return
        tokens, lengths = drafter.propose([w.seq.tokens + w.cand], [min(w.k - own, w.cap - len(w.cand))],
                                          [w.seq.tenant], **({"min_confidence": [w.min_confidence]} if sized else {}))
        more = tokens[0, : int(lengths[0])].tolist()
        more = more[: w.seq.grammar.valid_prefix(w.seq.output_ids, more, w.cand)]
        n = len(w.cand)
        w.cand.extend(more)
        if fields:
            take_field_draft(w, n)
        if len(w.cand) == n:
            return


def take_field_draft(w, at: int = 0) -> None:
    """Replace the model-free candidates after position `at` of `w.cand` (the drafter's
    proposal there) by the row's field draft from that position (the same budget: what remains
    of k own tokens, up to the row's cap) unless the proposal extends it (`preferred`)."""
    g = w.seq.grammar
    if g.fields is None:
        return
    budget = min(w.k - own_count(w, at), w.cap - at)
    if budget <= 0:
        return
    own = w.cand[at:]
    chosen = preferred(g, w.seq.output_ids, w.cand[:at], own, budget)
    if chosen is not own:
        del w.cand[at:]
        w.cand.extend(chosen)


def preferred(grammar, generated: list[int], path: list[int], own: list[int], budget: int,
              first: list[int] | None = None) -> list[int]:
    """A model-free drafter's proposal `own` after `generated` + `path` (cut where the grammar
    refuses it) checked against the row's field drafts (up to `budget` tokens): walking along
    `own`, a field draft where one comes (and the tokens the grammar forces after it), else the
    drafter's tokens up to the next place a value may start; at the first field draft `own`
    differs from, the field draft replaces the rest of `own` (returned: `own[:at] + draft`);
    `own` itself where it agrees with every field draft on its path (or has none), or the field
    draft where `own` stops inside it. Where they differ, the field draft is the better bet: it
    is built for this place in the output from the grammar and the prompt, where a drafter
    copies a continuation of the context (an earlier record's values, the last item's quantity:
    docs/structured-output.md "Field drafts (session 22)"). `first`: the field draft at the
    start (`fields.propose(grammar, generated, path, budget)`), where the caller has it."""
    fields = grammar.fields
    piece, at = fields.propose(grammar, generated, path, budget) if first is None else first, 0
    for _ in range(FIELD_ROUNDS):
        if piece:
            n = next((i for i, (a, b) in enumerate(zip(own[at:], piece)) if a != b), min(len(piece), len(own) - at))
            if n < len(piece):  # they differ, or `own` stops inside the field draft
                return own[:at] + piece
            at += len(piece)
            if at < len(own):  # (own holds the tokens forced after the piece: it is a grammar path)
                at += len(grammar.forced_tokens(generated, len(own) - at, path + own[:at]))
        else:  # no field draft here: the drafter's tokens stand up to the next value's start
            at = _next_value_start(fields.decode, own, at, fields.decode(generated + path + own[:at]))
            if at < len(own):  # past the text the grammar forces there (a key after `,`, a space
                # after `:`): a field draft is proposed only where a value starts (review22 D6)
                at += len(grammar.forced_tokens(generated, len(own) - at, path + own[:at]))
        if at >= len(own):
            return own
        piece = fields.propose(grammar, generated, path + own[:at], budget - at)
    return own


def _next_value_start(decode, tokens: list[int], at: int, before: str) -> int:
    """The first position after `at` where the text of `tokens[at:]` so far ends where a JSON
    value may start: after a `:`, `[` or `,` outside a string (review22 N9: not `"London, England"`),
    whitespace and an opening quote; len(tokens) where none. `before`: the output's text up to
    `at` (JSON so far: where its strings are)."""
    quoted = _unescaped(before).count('"') % 2 == 1  # inside a string at `at`
    escaped = start = False
    for i in range(at, len(tokens)):
        for ch in decode([tokens[i]]):
            if quoted:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    quoted = False
                start = False  # a value's text (or its end)
            elif ch in ":[,":
                start = True
            elif ch == '"':
                quoted = True  # a string opens: a value's start stays one after its quote
            elif not ch.isspace():
                start = False
        if start:
            return i + 1
    return len(tokens)


def _unescaped(text: str) -> str:
    """`text` without its escaped characters (`\\"` inside a string)."""
    return re.sub(r"\\.", "", text)


def own_count(w, n: int) -> int:
    """Tokens of the first `n` candidate positions that some drafter proposed (not forced)."""
    return n - bisect_left(w.forced, n)


@dataclass
class CertainCounts:
    """What happened to certain candidates at the levels that verified them (the executor's
    running totals: `ChainExecutor.certain_counts`). `rejected` counts a level's first rejection
    falling on a certain candidate: never, when they are what the grammar forces there."""

    offered: int = 0  # certain candidates that reached a verifying level
    accepted: int = 0  # ... that it accepted
    rejected: int = 0  # levels whose first rejection was a certain candidate


def count(c: CertainCounts, w, a: int) -> None:
    """A level verified `w.cand` (certain positions `w.forced`) and accepted its first `a`."""
    n = len(w.cand)
    offered = n - own_count(w, n)
    if offered:
        c.offered += offered
        c.accepted += a - own_count(w, a)
        c.rejected += a < n and own_count(w, a + 1) == own_count(w, a)  # position a is certain


def keep_prefix(w, n: int) -> None:
    """A level kept the first `n` candidates (accepted): forced positions past them are gone."""
    del w.forced[bisect_left(w.forced, n):]
