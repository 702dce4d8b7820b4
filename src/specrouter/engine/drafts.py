"""What the engine asks of model-free drafters around a router's plans: confident drafts
(suffix decoding's rule) before a step, shadow proposals (free evidence) around it.

- **Confident drafts.** A greedy row whose confidence-sized drafter (suffix) matches earlier
  requests with a long confident draft (an exact retry, a template's fixed text) is offered to
  the router (`RouterProtocol.take_confident_drafts`), which takes it when the cost model says
  the step gains. The router's acceptance estimates average over the request's cycles and
  cannot see such a draft coming. A row that had none is checked again PEEK_BACKOFF steps later
  (a check costs one proposal, ~0.1-0.3 ms).
- **Shadow proposals.** What each model-free drafter would propose for the rows that do not run
  it (tens of microseconds per row), judged after the step against what the target committed
  and against the row's first model level's own tokens (a draft model's proposal, or what it
  passed up verifying a model-free draft; exact in both modes: every level samples with the
  same position-keyed noise): the router's evidence for drafters it is not running, also as
  drafters of that model (three-level chains).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from specrouter.config import MAX_DRAFT_LENGTH
from specrouter.decoding.certain_drafts import preferred
from specrouter.drafters.base import DrafterProtocol, as_int64
from specrouter.records.routing import Plan, RowOutcome, ShadowProposal
from specrouter.state.sequence import Sequence as Row

CONFIDENT = 0.5  # a confident draft: every token's cumulative confidence >= this
CONFIDENT_MIN = 3  # ... and at least this many tokens
CONFIDENT_MATCH = 8  # ... from a match of at least this many context tokens (one earlier
# occurrence of a short match has confidence 1 and predicts little: measured, a 3-token gate
# let chat greedy drop to 0.90x of SpecRouter without the suffix drafter)
PEEK_BACKOFF = 4  # engine steps between checks of a row whose last check found none


def confident_offers(rows: Sequence[Row], plans: Sequence[Plan], drafters: Mapping[str, DrafterProtocol],
                     step: int) -> dict[int, tuple[str, int, float]]:
    """Row index -> (drafter, m tokens, its expected accepted tokens) for the greedy rows whose
    confidence-sized drafter offers a confident draft now that their plan does not already run;
    updates each checked row's `plan.peek_at` (engine steps)."""
    sized = [(n, d) for n, d in drafters.items() if d.sized_by_confidence]
    offers: dict[int, tuple[str, int, float]] = {}
    if not sized:
        return offers
    for i, (seq, (chain, k)) in enumerate(zip(rows, plans)):
        k_cap = min(MAX_DRAFT_LENGTH, seq.remaining - 1)
        if not seq.params.greedy or k_cap < CONFIDENT_MIN or seq.plan.peek_at > step:
            continue
        context = as_int64(seq.tokens)
        for name, drafter in sized:
            p = drafter.propose_row(context, k_cap, seq.tenant, CONFIDENT)
            m = int(p.tokens.shape[0])
            if (m >= CONFIDENT_MIN and p.match_len >= CONFIDENT_MATCH
                    and not (chain[0] == name and k >= m)):
                offers[i] = (name, m, p.score)
        seq.plan.peek_at = step + (1 if i in offers else PEEK_BACKOFF)
    return offers


def shadow_proposals(rows: Sequence[Row], plans: Sequence[Plan], drafters: Mapping[str, DrafterProtocol],
                     k: int, fields: bool = False) -> dict[str, dict[int, list[int]]]:
    """drafter -> row index -> what it proposes (asked for k tokens) for the rows not running it.
    With `fields` (the executor's field drafts on), a constrained row's proposal is what the
    executor would draft first: the drafter's, cut where the grammar refuses it, with the row's
    field drafts in place of its tokens from the first one it differs from
    (decoding/certain_drafts.py `preferred`; up to the first grammar-forced token) while the
    row's field gate is open (decoding/field_gate.py), the drafter's own where it is closed."""
    out = {}
    first = {}  # row index -> its field draft at the output's end (one per row, whichever drafter)
    for name, drafter in drafters.items():
        idx = [b for b, (chain, _) in enumerate(plans) if chain[0] != name]
        if not idx:
            continue
        tokens, lengths = drafter.propose([rows[b].tokens for b in idx], k, [rows[b].tenant for b in idx])
        out[name] = {b: t[:m] for b, t, m in zip(idx, tokens.tolist(), lengths.tolist())}
        if not fields:
            continue
        for b in idx:
            g = rows[b].grammar
            if (g is None or g.fields is None or not g.fields.gate.open
                    or rows[b].params.allowed_token_ids is not None):
                continue
            own = out[name][b]
            own = own[: g.valid_prefix(rows[b].output_ids, own)]
            if b not in first:
                first[b] = g.fields.propose(g, rows[b].output_ids, [], k)
            out[name][b] = preferred(g, rows[b].output_ids, [], own, k, first[b])
    return out


def judge_shadows(rows: Sequence[Row], outcomes: Sequence[RowOutcome], drafted: Sequence[list[int]],
                  shadow: Mapping[str, Mapping[int, list[int]]], k: int,
                  model_free: Collection[str] = ()) -> list[ShadowProposal]:
    """The shadow proposals made before a step, each against the tokens the row committed, and
    against its first model level's own tokens (`drafted[b]`: a model drafter's proposal, or
    what the verifier of a model-free drafter passed up), in both modes: how that model would
    have judged them (its hit already counted). `model_free`: the model-free drafters' names."""
    out = []
    for name, proposals in shadow.items():
        for b, proposal in proposals.items():
            seq, o = rows[b], outcomes[b]
            out.append(ShadowProposal(seq.seq_id, name, proposal, seq.tokens[o.context_len:], k,
                                      seq.params.greedy))
            if drafted[b]:
                model = o.chain[1] if o.chain[0] in model_free else o.chain[0]
                out.append(ShadowProposal(seq.seq_id, name, proposal, drafted[b], len(drafted[b]),
                                          seq.params.greedy, verifier=model, count_hit=False))
    return out
