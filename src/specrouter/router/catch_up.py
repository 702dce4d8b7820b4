"""Catch-up evidence: a request decoding without its draft keeps measuring it.

A request whose plan leaves a model draft out (plain decoding, a model-free chain) learns
nothing new about that draft: its own estimate only fades back toward its prior
(`RouterConfig.request_idle_decay`), and a request whose first cycles met a run of misses can
decode plainly to its end while the draft would have paid (chat greedy, session 29: 12 cycles of
draft>target accepting 3 of 22, then 75 plain cycles at 0.97x target-only, where static
draft>target ran 1.22x on the same requests).

The draft has to see every committed token before it drafts again anyway (its catch-up). Here a
single stream whose draft lags by `RouterConfig.catch_up_every` generated tokens catches it up
in the step it is at, in a forward of its own, with the draft's logits at every position whose
next token the request generated. The executor samples the draft's token at each of them as it
would have drafted it (greedy: argmax; sampled: the position-keyed noise every level shares) and
compares it with the committed token: a draft token at a position equals the target's there
exactly when verification would have accepted it with the same prefix, so each position is one
acceptance trial of the pair (draft, target), the event the router's estimator counts
(similarity.py: accepted / (accepted + rejections)). The router folds them as the request's and
the pair's trials (`Router._observe_rows`).

Cost: one draft forward over the lagging tokens (SmolLM2's 11M draft, 2-core Intel Xeon with
AMX, bf16: 0.74 ms for 8 tokens with logits at all 8, against a 9.1 ms target step: ~1% of the
plain steps it covers); the draft's cache is then current, so speculating again pays no
catch-up. Never the target's output: the draft's tokens are only compared.

A row's logits processors (penalties, logit_bias, min_tokens) process the draft's logits at each
position with the committed tokens before it as their history, as on a draft path. Not for:
multi-row steps (under load the batch planner's margin, not the evidence, keeps rows plain, and a
catch-up would slow every row of the step), rows with a grammar (its state at a past position is
not kept; the executor leaves them out), draft heads and model-free drafters (shadow proposals
score those every cycle).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from specrouter.records.routing import Chain, RowContext


def catch_up_models(row: RowContext, chain: Chain, every: int, drafts: Collection[str],
                    failed: Collection[str] = ()) -> tuple[str, ...]:
    """The models of `drafts` (model drafts of the target) that `row`, planned to run `chain`
    this step, catches up for their evidence: those not in the chain (nor `failed`) lagging by
    at least `every` tokens the row generated (`RowContext.lags_generated`; a draft that never
    saw the prompt prefills it in the same forward). None where `every` <= 0 (the executor
    leaves a row with a grammar out: decoding/catch_up.py)."""
    if every <= 0 or not row.lags_generated:
        return ()
    return tuple(m for m, n in row.lags_generated
                 if n >= every and m in drafts and m not in chain and m not in failed)


def stream_catch_ups(rows: Sequence[RowContext], chains: Sequence[Chain], pinned: int, every: int,
                     drafts: Collection[str], failed: Collection[str] = ()) -> tuple[tuple[str, ...], ...]:
    """Per row of a step's plan (`BatchPlan.catch_up`; `pinned`: the step's pinned rows): a
    single stream's catch-ups; none in a multi-row step (module docstring). Every gate is here,
    cheapest first: `Router.plan_batch` calls it on every step."""
    if len(rows) != 1 or pinned or every <= 0 or not rows[0].lags_generated:
        return ()
    models = catch_up_models(rows[0], chains[0], every, drafts, failed)
    return (models,) if models else ()
