"""Growing a token tree from a drafter's alternatives, best-first by cumulative draft probability
under a node budget (EAGLE-2 style). Pure functions.

A model drafter drafts its chain as before (its *main path*: the token it samples at each
depth, one draft forward per depth), and at each depth its next-best tokens are *alternatives*:
leaves whose parent is the main path's node above (no extra draft forward). A node's score is
its cumulative draft log-probability (the main path's down to its parent, plus its own); the
tree keeps the `budget` best nodes. Every node scores at most its parent (log-probabilities are
<= 0), and ties keep the shallower node and the main path first, so the kept nodes always form a
tree. A budget of k nodes is the chain itself.

Rank evidence (what the shape policy learns from, engine/tree_policy.py): at each depth the
main path reached, the rank of the target's own token among the drafter's candidates there
(0: the main path's token; r >= 1: the r-th alternative; -1: none of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrouter.decoding.noise import token_noise
from specrouter.decoding.tree import TokenTree


@dataclass(frozen=True)
class DraftDepth:
    """What a drafter offered at one depth of its main path."""

    token: int  # the main path's token (what the drafter sampled)
    logprob: float  # its draft log-probability
    alternatives: tuple[tuple[int, float], ...]  # (token, draft log-probability), best first, main excluded


POOL = 32  # a sampling row ranks its alternatives among the drafter's this many likeliest tokens


def draft_depths(logits: torch.Tensor, chosen: list[int], width: int, temperature: list[float] | None = None,
                 keys: torch.Tensor | None = None) -> list[DraftDepth]:
    """Rows' logits (B, V) at one depth, the token each row drafted there -> per row its
    DraftDepth with up to `width - 1` alternatives. A greedy row (temperature 0 or None): the
    drafter's next likeliest tokens. A sampling row: the next best by the same noisy scores the
    target's coupled sample maximises (logits / temperature - log E, `keys` (B,) its position
    keys, noise.token_noise), among the drafter's POOL likeliest: the drafter's 2nd, 3rd guesses
    of the target's sample. Log-probabilities: the drafter's, at the row's temperature (1 if greedy)."""
    temps = torch.tensor([t if t else 1.0 for t in (temperature or [0.0] * len(chosen))],
                         dtype=torch.float32, device=logits.device)[:, None]  # (B, 1)
    scaled = logits.float() / temps  # (B, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    top_lp, top_tok = logp.topk(min(max(width, POOL), logp.shape[-1]), dim=-1)  # (B, W')
    noisy = [bool(t) for t in (temperature or [0.0] * len(chosen))]
    if any(noisy) and keys is not None:
        rows = torch.tensor([i for i, n in enumerate(noisy) if n], dtype=torch.long, device=logits.device)
        sub_tok = top_tok.index_select(0, rows)  # (R, W')
        score = top_lp.index_select(0, rows).double() - token_noise(keys.index_select(0, rows), sub_tok).log()
        order = score.argsort(dim=-1, descending=True)  # (R, W')
        top_tok = top_tok.index_copy(0, rows, sub_tok.gather(1, order))
        top_lp = top_lp.index_copy(0, rows, top_lp.index_select(0, rows).gather(1, order))
    main_lp = logp.gather(1, torch.tensor(chosen, dtype=torch.long, device=logp.device)[:, None])[:, 0]  # (B,)
    out = []
    for tok, mlp, toks, lps in zip(chosen, main_lp.tolist(), top_tok.tolist(), top_lp.tolist()):
        alts = tuple((t, lp) for t, lp in zip(toks, lps) if t != tok)[: width - 1]
        out.append(DraftDepth(tok, mlp, alts))
    return out


def grow_tree(depths: list[DraftDepth], budget: int, width: int) -> tuple[TokenTree, list[int]]:
    """The `budget` best nodes (cumulative draft log-probability) of the main path and its
    alternatives (up to `width - 1` per depth). Returns (the tree, each node's rank: 0 on the
    main path, r for the r-th alternative)."""
    cands = []  # (-score, depth, rank, token)
    cum = 0.0
    for d, dd in enumerate(depths):
        alts = dd.alternatives[: width - 1]
        for r, (tok, lp) in enumerate(alts, start=1):
            cands.append((-(cum + lp), d, r, tok))
        # the main path's node scores at least its alternatives (a sampled token may be less
        # likely than a sibling): the path the alternatives hang from is always kept first
        cum += max([dd.logprob] + [lp for _, lp in alts])
        cands.append((-cum, d, 0, dd.token))
    cands.sort(key=lambda c: (c[0], c[1], c[2]))
    kept = sorted(cands[:budget], key=lambda c: (c[1], c[2]))  # by depth, the main path first
    main_at: dict[int, int] = {}
    tokens, parents, ranks = [], [], []
    for _, d, r, tok in kept:
        parent = -1 if d == 0 else main_at.get(d - 1)
        if parent is None:  # cannot happen (scores fall along the path); kept for safety
            continue
        if r == 0:
            main_at[d] = len(tokens)
        tokens.append(tok), parents.append(parent), ranks.append(r)
    return TokenTree(tuple(tokens), tuple(parents)), ranks


def rank_evidence(depths: list[DraftDepth], target_tokens: list[int]) -> list[int]:
    """Per depth the main path reached, the rank of the target's token there among the drafter's
    candidates (0 main, r alternative, -1 none). `target_tokens[d]`: the target's token at depth
    d after the main path's first d tokens (available for d <= the main path's accepted length)."""
    out = []
    for dd, tok in zip(depths, target_tokens):
        if tok == dd.token:
            out.append(0)
            continue
        alts = [t for t, _ in dd.alternatives]
        out.append(alts.index(tok) + 1 if tok in alts else -1)
        break
    return out
