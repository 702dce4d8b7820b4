"""How well a drafter would speculate for the target, on held-out target-written rows: per-depth
agreement with the target's greedy tokens and the mean acceptance length for draft lengths k.

A *chain* starts after position s: the target has processed tokens 0..s (its feature of s is
known) and committed token s+1 (its greedy token there). Depth j drafts token s+j+1, to be
compared with the target's greedy label at s+j. For a head, depth j is `EagleHead.unrolled`'s
level j at position s+j-1 (it read its own predicted features for depths < j); for a standalone
draft, it is its argmax at position s+j given the text (along an accepted draft the text IS the
drafted tokens). Only starts whose next k text tokens are the target's greedy ones are scored
(the target-written greedy rows), so every scored chain is one greedy speculation would run.

Acceptance length counts the target's own token (docs/design.md): 1 + the accepted draft tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from specrouter.models.runners.base import ForwardBatch


def acceptance_stats(hits: torch.Tensor) -> tuple[list[float], dict[int, float]]:
    """hits (S, K) bool: chain s's depth-j draft equals the target's token. Returns (agreement at
    each depth j given depths < j accepted, [K]; {k: mean acceptance length for k = 1..K})."""
    S, K = hits.shape
    alive = torch.cumprod(hits.long(), 1)  # (S, K): depths 1..j all accepted
    reached = torch.cat([torch.full((1,), S), alive.sum(0)[:-1]])  # chains reaching depth j
    by_depth = [float(alive[:, j].sum() / reached[j]) if reached[j] > 0 else float("nan") for j in range(K)]
    lengths = {k: 1.0 + float(alive[:, :k].sum(1).double().mean()) if S else float("nan")
               for k in range(1, K + 1)}
    return by_depth, lengths


def greedy_starts(tokens: torch.Tensor, labels: torch.Tensor, length: int, k: int) -> torch.Tensor:
    """Chain starts s of one row (tokens (T,), labels (T,)) whose text follows the target's
    greedy path for k+1 tokens: tokens[s+i+1] == labels[s+i] for i = 0..k-1, and s+k < length."""
    n = length - k
    if n <= 0:
        return torch.zeros(0, dtype=torch.long)
    follows = tokens[1:length] == labels[: length - 1]  # (L-1,): position t's greedy token is the text's
    ok = torch.stack([follows[i : i + n] for i in range(k)]).all(0)  # (n,)
    return ok.nonzero()[:, 0]


@torch.no_grad()
def head_predictions(head, features: torch.Tensor, tokens: torch.Tensor, levels: int) -> torch.Tensor:
    """(levels, n) target ids: the head's argmax at every position and depth of one row
    (features (L, H), tokens (L,)), n = L - 1."""
    outs = head.unrolled(features[None].float(), tokens[None], levels=levels)
    return torch.stack([head.vocab_ids[head.logits(g[0]).argmax(-1)] for g in outs])


def head_hits(preds: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(S, K) hits of a head: preds (K, n) from `head_predictions`; depth j of start s is its
    level j at position s+j-1 against labels[s+j]."""
    K = preds.shape[0]
    j = torch.arange(1, K + 1)
    return preds[j - 1, starts[:, None] + j - 1] == labels[starts[:, None] + j]


def draft_hits(preds: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor, k: int) -> torch.Tensor:
    """(S, k) hits of a standalone draft: preds (T,) its argmax at each position given the text;
    depth j of start s is its argmax at s+j against labels[s+j]."""
    at = starts[:, None] + torch.arange(1, k + 1)
    return preds[at] == labels[at]


@dataclass
class DrafterReport:
    """A drafter on held-out target-written rows (see the module docstring)."""

    agreement: float  # depth 1, every held-out position (teacher forced): the per-token proxy
    agreement_by_source: dict[str, float]
    agreement_by_depth: list[float]  # greedy chains: depth j given depths < j accepted
    acceptance_length: dict[int, float]  # k -> mean acceptance length (greedy chains)
    positions: int  # positions of `agreement`
    chains: int  # greedy chain starts scored
    extra: dict = field(default_factory=dict)


def drafter_report(row_preds, corpus, features_labels: torch.Tensor, rows: torch.Tensor, k: int,
                   *, head: bool) -> DrafterReport:
    """Aggregate hits over held-out `rows`. row_preds(r) -> predictions of row r: (k, L-1) from
    `head_predictions` when `head`, else (L,) argmax of a standalone draft."""
    from specrouter.distill.corpus import SOURCES

    names = list(SOURCES)
    hit_d1: dict[str, list[int]] = {}
    chains = []
    for r in rows.tolist():
        L = int(corpus.lengths[r])
        if L < 3:
            continue
        tokens, labels = corpus.tokens[r, :L], features_labels[r, :L]
        labelled = int((labels >= 0).sum())  # a generated row's last token has no label
        preds = row_preds(r)
        d1 = preds[0] == labels[1:L] if head else preds[1:L] == labels[1:L]  # positions 1..L-1
        h = hit_d1.setdefault(names[int(corpus.source[r])], [0, 0])
        h[0] += int((d1 & (labels[1:L] >= 0)).sum())
        h[1] += labelled - 1
        starts = greedy_starts(tokens, labels, labelled, k)
        if len(starts):
            chains.append(head_hits(preds, labels, starts) if head else draft_hits(preds, labels, starts, k))
    hits = torch.cat(chains) if chains else torch.zeros(0, k, dtype=torch.bool)
    by_depth, lengths = acceptance_stats(hits)
    total = sum(h[1] for h in hit_d1.values())
    return DrafterReport(
        agreement=sum(h[0] for h in hit_d1.values()) / total if total else float("nan"),
        agreement_by_source={n: h[0] / h[1] for n, h in hit_d1.items()},
        agreement_by_depth=by_depth, acceptance_length=lengths, positions=total, chains=len(hits))


@torch.no_grad()
def draft_row_argmax(runner, tokens: torch.Tensor) -> torch.Tensor:
    """(L,) argmax of a standalone draft runner at every position of one row (slot 0)."""
    L = len(tokens)
    batch = ForwardBatch.build([0], [0], [tokens.tolist()], [list(range(L))])
    return runner.forward(batch)[0].argmax(-1)


@torch.no_grad()
def native_depth1_agreement(head_runner, corpus, features: torch.Tensor, labels: torch.Tensor,
                            rows: torch.Tensor) -> float:
    """Depth-1 agreement of a HeadRunner (the engine's kernels and precision) on `rows`: one
    step per row over all its positions, reading the target's features (teacher forced)."""
    hits = total = 0
    for r in rows.tolist():
        L = int(corpus.lengths[r])
        if L < 3:
            continue
        toks = corpus.tokens[r, 1:L].tolist()  # position t reads feature t with token t+1
        batch = ForwardBatch.build([0], [0], [toks], [list(range(L - 1))])
        logits, _ = head_runner.step(batch, features[r : r + 1, : L - 1].to(head_runner.dtype))
        lab = labels[r, 1:L]
        ok = lab >= 0
        hits += int(((logits[0].argmax(-1) == lab) & ok).sum())
        total += int(ok.sum())
    return hits / total if total else float("nan")


@torch.no_grad()
def native_chain_hits(head_runner, tokens: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                      starts: torch.Tensor, k: int, slots: int = 8) -> torch.Tensor:
    """(S, k) hits of a HeadRunner drafting k steps from each start, as the engine would: one
    row (tokens (L,), its target features (L, H), labels (L,)). Each of `slots` cache slots
    holds the row prefilled with the target's features and runs its share of the starts in
    decreasing order (a chain from s rewrites positions >= s only, which later chains, starting
    before s, never read); the slots draft side by side, one batch per step."""
    L = len(tokens)
    slots = max(1, min(slots, len(starts), head_runner.layer.num_slots))
    toks = tokens.tolist()
    feats = features[None].to(head_runner.dtype)  # (1, L, H)
    head_runner.step(ForwardBatch.build(list(range(slots)), [0] * slots, [toks[1:L]] * slots, [[0]] * slots),
                     feats[:, : L - 1].expand(slots, -1, -1))
    order = starts.flip(0).tolist()  # decreasing
    hits = {}
    for i in range(0, len(order), slots):
        group = order[i : i + slots]
        B = len(group)
        fed = torch.stack([feats[0, s] for s in group])[:, None]  # (B, 1, H)
        row_hits = []
        for j in range(1, k + 1):
            batch = ForwardBatch.build(list(range(B)), [s + j - 1 for s in group], [[toks[s + j]] for s in group],
                                       [[0]] * B)
            logits, fed = head_runner.step(batch, fed)
            row_hits.append(logits[:, 0].argmax(-1) == labels[torch.tensor(group) + j])
        for b, s in enumerate(group):
            hits[s] = torch.stack(row_hits, 1)[b]
    return torch.stack([hits[s] for s in starts.tolist()]) if len(starts) else torch.zeros(0, k, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# Step cost


def _median_ms(fn, steps: int) -> float:
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.no_grad()
def target_step_ms(runner, context: int = 128, steps: int = 32, seed: int = 0) -> float:
    """Median ms of a 1-token decode step of a LlamaRunner after `context` tokens (slot 0)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, runner.vocab_size, (context + steps + 1,), generator=g).tolist()
    runner.forward(ForwardBatch.build([0], [0], [toks[:context]], [[context - 1]]))
    return _median_ms(lambda i: runner.forward(
        ForwardBatch.build([0], [context + i], [[toks[context + i]]], [[0]])), steps)


@torch.no_grad()
def head_step_ms(head_runner, context: int = 128, steps: int = 32, seed: int = 0) -> float:
    """Median ms of one draft step of a HeadRunner after `context` cached positions (slot 0),
    each step feeding the feature it predicted the step before (how it drafts)."""
    layer = head_runner.layer
    g = torch.Generator().manual_seed(seed)
    H = layer.arch.hidden_size
    toks = torch.randint(0, layer.vocab_size, (context + steps + 1,), generator=g).tolist()
    feats = torch.randn(1, context, H, generator=g).to(head_runner.dtype)
    _, f = head_runner.step(ForwardBatch.build([0], [0], [toks[:context]], [[context - 1]]), feats)
    state = {"f": f[:, -1:]}

    def one(i: int) -> None:
        _, state["f"] = head_runner.step(
            ForwardBatch.build([0], [context + i], [[toks[context + i]]], [[0]]), state["f"])

    return _median_ms(one, steps)
