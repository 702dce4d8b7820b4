"""Growing a token tree with a model drafter, depth by depth (EAGLE-2's `topK_genrate`), inside
one executor step (docs/trees.md).

A row drafting a tree of depth D (the router's draft length k), width W, C children per node
(`RowWork.tree_children`; 0: C = W) and node budget N:
1. depth 0: the drafter's shared first forward (its pending tokens) gives the root's logits; the
   root's C best children become nodes;
2. depths 1..D-1: the *frontier* (the W best nodes of the depth just made, by cumulative draft
   log-probability) is expanded in ONE draft forward over the rows still growing: each row feeds
   its frontier and their ancestors as a token tree (`ForwardBatch.parents`: the draft's runner
   attends each node's own branch, so each frontier node's logits are those of drafting its
   path), and every frontier node gets its C best children (more children cost no draft
   forward: only the frontier, W, sets what a draft forward feeds);
3. the tree the target verifies keeps the N best nodes of all drafted ones by cumulative draft
   log-probability (a node never scores above its parent, and ties keep the shallower node, so
   the kept nodes form a tree).
D forwards of the drafter, as for a chain of k; a forward feeds at most W * (D - 1) tokens.

Children, best first: a greedy row's are the drafter's likeliest tokens; a sampling row's the
best by the same noisy scores the target's coupled sample maximises (logits / temperature -
log E at the child's position, `noise.token_noise`), among the drafter's POOL likeliest: its
first child is the drafter's own sample. A node's *rank* is its place among its parent's
children (0: the drafter's own choice); the *main path* is rank 0 all the way down (the chain
the drafter would have drafted: the router's evidence stays the chain's).

The drafter's cache past the committed tokens is scratch: after the cycle it keeps only the
committed prefix it held before drafting, and the accepted tokens are fed to it at its next
forward (a few more tokens in a forward of a small model; no KV moves in the drafter).

Rank evidence (what the shape policy learns from, engine/tree_policy.py): at the root and at each
accepted node the drafter expanded, the rank of the target's own token among the node's W
children (-1: none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specrouter.decoding.noise import native_ops, position_key, token_noise
from specrouter.decoding.tree import TokenTree
from specrouter.models.runners.base import ForwardBatch

POOL = 32  # a sampling row ranks its children among the drafter's this many likeliest tokens


@dataclass
class DraftTree:
    """A row's draft tree while it grows: node i is `tokens[i]` under `parents[i]` (-1: the
    root), in creation order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    ranks: list[int] = field(default_factory=list)  # place among its parent's children
    children: dict[int, list[int]] = field(default_factory=dict)  # expanded node (-1: root) -> children, best first
    frontier: list[int] = field(default_factory=list)  # the nodes the next draft forward expands

    def expand(self, node: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Node `node` (-1: the root) gets children `tokens` (best first) with their draft
        log-probabilities; returns their ids."""
        base = 0.0 if node < 0 else self.scores[node]
        depth = 0 if node < 0 else self.depths[node] + 1
        ids = []
        for r, (t, lp) in enumerate(zip(tokens, logprobs)):
            ids.append(len(self.tokens))
            self.tokens.append(t), self.parents.append(node), self.depths.append(depth)
            self.scores.append(base + lp), self.ranks.append(r)
        self.children[node] = ids
        return ids

    def feed(self) -> tuple[list[int], list[int], list[int]]:
        """What a draft forward expanding the frontier feeds: the frontier and its ancestors in
        creation order (node ids), each one's parent among them (-1: a child of the root), and
        the frontier's places among them (where its logits are read)."""
        need: set[int] = set()
        for n in self.frontier:
            while n >= 0 and n not in need:
                need.add(n)
                n = self.parents[n]
        ids = sorted(need)
        at = {n: i for i, n in enumerate(ids)}
        return ids, [at.get(self.parents[n], -1) for n in ids], [at[n] for n in self.frontier]

    def best(self, budget: int) -> tuple[TokenTree, list[int]]:
        """The `budget` best nodes as the tree the target verifies, and their node ids."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))
        kept = sorted(order[:budget])
        at = {n: i for i, n in enumerate(kept)}
        return TokenTree(tuple(self.tokens[n] for n in kept), tuple(at[self.parents[n]] if self.parents[n] >= 0
                                                                   else -1 for n in kept)), kept

    def main_path(self) -> list[int]:
        """The rank-0 nodes from the root down, as far as they were drafted."""
        out, node = [], -1
        while node in self.children and self.children[node]:
            node = self.children[node][0]
            out.append(node)
        return out

    def evidence(self, path: list[int], target_tokens: list[int]) -> tuple[int, ...]:
        """Rank evidence along the accepted branch `path` (node ids, root side first):
        `target_tokens[j]` is the target's token after the root (j = 0) or after path[j - 1]."""
        out = []
        for node, tok in zip([-1, *path], target_tokens):
            kids = self.children.get(node)
            if not kids:
                break
            toks = [self.tokens[c] for c in kids]
            out.append(toks.index(tok) if tok in toks else -1)
        return tuple(out)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` (values, indices) of a (R, V) tensor, bit for bit, ties in torch's own
    order: the native `topk_rows` (kernels/tree.cpp: torch's partial_sort replayed, most of the
    row skipped by vector compares; ~6 us a row of 49k against ~80) where it applies (CPU
    float32, k * 64 <= V: torch's partial_sort path), else torch's."""
    ops = native_ops() if x.device.type == "cpu" and x.dtype == torch.float32 and 1 <= k and k * 64 <= x.shape[-1] else None
    return ops.topk_rows(x, k) if ops is not None else x.topk(k, dim=-1)


def rank_children(logits: torch.Tensor, width: int, temperature: list[float],
                  keys: torch.Tensor | None) -> tuple[list[list[int]], list[list[float]]]:
    """Logits (R, V) at R nodes being expanded -> per node its `width` best children and their
    draft log-probabilities (at the row's temperature; 1 if greedy), best first (module doc: a
    greedy node by probability, a sampling node (temperature > 0) by its noisy score at the
    children's position, `keys` (R,) int64)."""
    x = logits.float()
    if any(temperature):  # x / 1 is x: greedy rows alone skip the division
        x = x / torch.tensor([t if t else 1.0 for t in temperature], dtype=torch.float32, device=x.device)[:, None]
    logp = torch.log_softmax(x, dim=-1)  # (R, V)
    noisy = [i for i, t in enumerate(temperature) if t]
    top_lp, top_tok = topk(logp, min(max(width, POOL) if noisy else width, logp.shape[-1]))  # (R, W')
    if noisy and keys is not None:
        rows = torch.tensor(noisy, dtype=torch.long, device=logits.device)
        sub_tok, sub_lp = top_tok.index_select(0, rows), top_lp.index_select(0, rows)  # (R', W')
        score = sub_lp.double() - token_noise(keys.index_select(0, rows.to(keys.device)), sub_tok.cpu()).log().to(sub_lp.device)
        order = score.argsort(dim=-1, descending=True)  # (R', W')
        top_tok = top_tok.index_copy(0, rows, sub_tok.gather(1, order))
        top_lp = top_lp.index_copy(0, rows, sub_lp.gather(1, order))
    return top_tok[:, :width].tolist(), top_lp[:, :width].tolist()


def _expand_rows(ex, work: list, trees: list[DraftTree], nodes: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
    """Expand node lists `nodes[b]` of row b (-1: the root), their logits (sum of lengths, V)
    in that order; returns each row's new node ids."""
    owner = [(b, n) for b, ns in enumerate(nodes) for n in ns]
    temps = [work[b].seq.params.temperature for b, _ in owner]
    keys = None
    if any(temps):  # a child's noise is keyed by its position: start + its depth
        keys = torch.tensor([position_key(work[b].seq.seed_key, work[b].start + (0 if n < 0 else trees[b].depths[n] + 1))
                             for b, n in owner], dtype=torch.long)
    children = [w.tree_children or w.tree_width for w in work]
    toks, lps = rank_children(logits, max(children), temps, keys)
    new: list[list[int]] = [[] for _ in work]
    for (b, n), t, lp in zip(owner, toks, lps):
        c = children[b]
        new[b] += trees[b].expand(n, t[:c], lp[:c])
    return new


def draft_tree(ex, name: str, work: list, root_logits: torch.Tensor) -> None:
    """Rows of `work` (RowWork with a tree budget, drafting with model `name`, their shared
    first forward done: `root_logits` (B, V)) grow their trees (module docstring); each row's
    `tree` (what the target verifies), `tree_ids` (its nodes' draft ids), `draft_tree`, and its
    main path as `cand`. `ex` is the ChainExecutor."""
    trees = [DraftTree() for _ in work]
    new = _expand_rows(ex, work, trees, [[-1] for _ in work], root_logits)
    depth = 1
    while True:
        active = [b for b, w in enumerate(work) if w.k > depth]
        if not active:
            break
        slots, starts, feeds, parents, wanted = [], [], [], [], []
        for b in active:
            t, w = trees[b], work[b]
            t.frontier = sorted(new[b], key=lambda i: (-t.scores[i], i))[: w.tree_width]
            ids, par, at = t.feed()
            st = ex.state.state(w.seq.seq_id, name)
            assert st.cache_len == w.start and not st.speculative, "the drafter's first forward fed the row"
            slots.append(st.slot), starts.append(w.start), feeds.append([t.tokens[i] for i in ids])
            parents.append(par), wanted.append(at)
        batch = ForwardBatch.build(slots, starts, feeds, wanted, parents=parents)
        logits = ex._timed_forward(name, batch, len(active), ex._width(name, batch, len(active)))  # (B', G, V)
        flat = (logits[0, : len(wanted[0])] if len(wanted) == 1  # (sum frontier, V)
                else torch.cat([logits[i, : len(at)] for i, at in enumerate(wanted)]))
        grown = _expand_rows(ex, [work[b] for b in active], [trees[b] for b in active],
                             [trees[b].frontier for b in active], flat)
        new = [[] for _ in work]
        for b, g in zip(active, grown):
            new[b] = g
        depth += 1
    for w, t in zip(work, trees):
        w.draft_tree = t
        w.tree, w.tree_ids = t.best(w.tree_budget)
        w.cand = [t.tokens[i] for i in t.main_path()]
        w.drafted[0] = len(w.cand)
        if w.seq.params.greedy:
            w.proposal = list(w.cand)
