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

from specrouter.decoding.field_gate import Contest
from specrouter.decoding.json_scan import JsonScan
from specrouter.state.sequence import common_prefix_len

FREE_ROUNDS = 2  # a model-free drafter is asked again after forced tokens at most this often
FIELD_ROUNDS = 8  # ... with field drafts (one a field: a draft may span this many)
REACH = 0.3  # a field-drafted draft ends at a value start the target reaches with less probability
VALUE_PRIOR, PRIOR_VALUES = 0.7, 2  # a row's rate of values accepted whole before its own evidence (as this many)


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
    rounds = FIELD_ROUNDS if fields and offers_fields(w) else FREE_ROUNDS
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


def offers_fields(w) -> bool:
    """Whether a constrained row is offered field drafts this cycle: it has a field drafter and
    its gate is open (decoding/field_gate.py: their realised gain in its request)."""
    fields = w.seq.grammar.fields
    return fields is not None and fields.gate.open


def take_field_draft(w, at: int = 0) -> None:
    """Replace the model-free candidates after position `at` of `w.cand` (the drafter's
    proposal there) by the row's field draft from that position (the same budget: what remains
    of k own tokens, up to the row's cap) unless the proposal extends it (`preferred`), while
    the row's gate is open. The cycle's first place where they differ is its contest
    (`w.contest`), scored after the target's verification whichever was offered
    (decoding/field_gate.py)."""
    g = w.seq.grammar
    if g.fields is None or (w.contest is not None and not g.fields.gate.open):
        return  # (closed: the field draft is only a shadow, and the cycle's first contest is taken)
    budget = min(w.k - own_count(w, at), w.cap - at)
    if budget <= 0:
        return
    own = w.cand[at:]
    chosen = preferred(g, w.seq.output_ids, w.cand[:at], own, budget)
    if chosen is own:
        return
    offer = g.fields.gate.open
    if w.contest is None:
        q = common_prefix_len(own, chosen)
        w.contest = Contest(w.start + at + q, w.cand[:at] + own[:q], chosen[q:], own[q:], offer)
    if offer:
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
    scan, scanned = None, 0  # the JSON scan after generated + path + own[:scanned] (made where needed)
    for _ in range(FIELD_ROUNDS):
        if piece:
            n = next((i for i, (a, b) in enumerate(zip(own[at:], piece)) if a != b), min(len(piece), len(own) - at))
            if n < len(piece):  # they differ, or `own` stops inside the field draft
                return own[:at] + piece
            at += len(piece)
            if at < len(own):  # (own holds the tokens forced after the piece: it is a grammar path)
                at += len(grammar.forced_tokens(generated, len(own) - at, path + own[:at]))
        else:  # no field draft here: the drafter's tokens stand up to the next value's start
            if scan is None:
                scan = fields.scan(generated, path)
            scan.feed(fields.decode(own[scanned:at]))
            scanned = at
            at = _next_value_start(fields.decode, own, at, scan)
            if at < len(own):  # past the text the grammar forces there (a key after `,`, a space
                # after `:`): a field draft is proposed only where a value starts (review22 D6)
                at += len(grammar.forced_tokens(generated, len(own) - at, path + own[:at]))
        if at >= len(own):
            return own
        piece = fields.propose(grammar, generated, path + own[:at], budget - at)
    return own


def _next_value_start(decode, tokens: list[int], at: int, before: JsonScan) -> int:
    """The first position after `at` where the text of `tokens[at:]` so far ends where a JSON
    value may start: after a `:`, `[` or `,` outside a string (review22 N9: not `"London, England"`),
    whitespace and an opening quote; len(tokens) where none. `before`: the scan of the output's
    text up to `at` (JSON so far: where its strings are; left as it is)."""
    return next(_value_starts(decode, tokens, at, before), len(tokens))


def _value_starts(decode, tokens: list[int], at: int, before: JsonScan):
    """The positions after `at` where a JSON value may start (`_next_value_start`), one for each
    string, number or literal (an object or array is not one: its members are): the first
    position after its `:`, an array's `[` or `,` (an object's `,` is followed by a key).
    `before`: the scan of the text up to `at` (left as it is)."""
    scan = before.copy()
    armed, pending = False, None  # after a separator, before the value's first character; its position
    for i in range(at, len(tokens)):
        for ch in decode([tokens[i]]):
            inside = scan.quoted
            scan.step(ch)
            if inside:
                if armed:  # a string value's first character (or its end): it started at `pending`
                    if pending is not None:
                        yield pending
                    armed, pending = False, None
            elif ch == ":" or ch == "[" or (ch == "," and scan.nest[-1:] == ["["]):
                armed, pending = True, None
            elif ch != '"' and not ch.isspace():  # (a `"` opens a key, or (armed) a string value)
                if armed and pending is not None and ch not in "{]}":  # a number or a literal
                    yield pending
                armed, pending = False, None
        if armed and pending is None:
            pending = i + 1
    if armed and pending is not None:
        yield pending


def cut_values(w, fields) -> None:
    """End a constrained row's model-free draft (with field drafts) at the first value start j
    (1, 2, ... in `w.cand`) the target reaches with a probability below REACH: r^j, r the row's
    rate of values accepted whole once reached (`count_values`; VALUE_PRIOR before evidence).
    A candidate costs the verifying forward ~0.25 ms whether or not it is reached, and a guessed
    value is accepted whole 50-90% of the time: the candidates behind a third or fourth guess
    were mostly verified in vain (docs/structured-output.md "Field drafts (session 23)");
    the row's values in `w.values` (for `count_values`). The draft keeps the value's opening
    (whitespace, its quote): the target's bonus token is then the value's first, where a cut
    before the opening left it on the opening a field draft proposes anyway (session 24)."""
    r = (fields.values_taken + VALUE_PRIOR * PRIOR_VALUES) / (fields.values_reached + PRIOR_VALUES)
    w.values = []
    reach = 1.0
    for at in _value_starts(fields.decode, w.cand, 0, fields.scan(w.seq.output_ids)):
        reach *= r
        w.values.append(at)
        if reach < REACH:  # (the value before ends here: `count_values` counts it)
            at = _past_opening(fields.decode, w.cand, at)
            del w.cand[at:]
            keep_prefix(w, at)
            break


def _past_opening(decode, tokens: list[int], at: int) -> int:
    """The position after a value's opening at `at` in `tokens`: the tokens holding only whitespace
    and quotes (` "`, ` `; an empty string's `""` too: the draft is only shorter)."""
    while at < len(tokens) and not decode(tokens[at:at + 1]).strip(' "'):
        at += 1
    return at


def count_values(fields, values: list[int], a: int) -> None:
    """The target accepted the first `a` candidates of a draft whose values start at `values`:
    each value that starts before another does was reached when the candidates before it were
    accepted, and taken when all of its own were."""
    for start, end in zip(values, values[1:]):
        if a >= start:
            fields.values_reached += 1
            fields.values_taken += a >= end


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
