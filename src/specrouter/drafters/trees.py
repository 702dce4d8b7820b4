"""Token trees from a model-free drafter (issue 28, docs/trees.md "Suffix trees"): where the
matched context suffix was followed by different tokens at its occurrences, propose several
continuations at once, weighted by how often each followed (SuffixDecoding's speculation tree,
arXiv 2411.04975), for the target to verify in one forward.

A node's *confidence* is the fraction of the matched occurrences that continue along its path
(the product, down its path, of count(child token) / count(occurrences alive at the parent); an
occurrence that ends, at a request separator or at the end of the corpus, counts in the
denominator): the expected acceptance of the node under the drafter's frequency model, as a
chain proposal's cumulative confidence is (`suffix.walk`: the main path below IS that chain).

`grow` builds the tree best-first: the most confident nodes first, at most `budget` of them, none
below `min_prob`, none deeper than `max_depth`. Nodes come in that order (a parent before its
children, since a child is never more confident than its parent and ties keep the shallower), and
a node's children in decreasing confidence, so the *main path* (every node's first child) is the
chain the drafter would have proposed. Pure functions over numpy arrays; the executor turns a
`TreeProposal` into the `TokenTree` the target verifies (decoding/tree.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import numpy.ma  # noqa: F401 - np.unique's first call imports it lazily (~9 ms; request_state.py)

SEPARATOR = -1  # ends a continuation (between requests in a store; matches no token)


@dataclass(frozen=True)
class TreeProposal:
    """One row's proposed tree: node i is `tokens[i]` under node `parents[i]` (-1: a child of the
    row's last token), in best-first order (module docstring)."""

    tokens: np.ndarray  # (n,) int64
    parents: np.ndarray  # (n,) int64, each < its own index
    confidence: np.ndarray  # (n,) float64 fraction of the matched occurrences that follow the node's path
    match_len: int  # length of the matched context suffix (0: no match)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def score(self) -> float:
        """Expected accepted tokens under the frequency model (every node's confidence summed:
        a node is accepted iff its whole path is)."""
        return float(self.confidence.sum())

    def main_path(self) -> list[int]:
        """Nodes of the first child of every node from the root down (the chain proposal)."""
        out, node = [], -1
        for i, p in enumerate(self.parents.tolist()):
            if p == node:
                out.append(i)
                node = i
        return out


EMPTY_TREE = TreeProposal(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), 0)


def _children(corpus: np.ndarray, ends: np.ndarray, limit: int, rows: np.ndarray, depth: int
              ) -> list[tuple[int, int, np.ndarray]]:
    """(token, count, rows that continue with it) of the tokens following the occurrences `rows`
    (indices into `ends`) at offset depth + 1, most frequent first (ties: smaller token)."""
    idx = ends[rows] + depth + 1  # (R,)
    nxt = np.where(idx < limit, corpus[np.minimum(idx, limit - 1)], SEPARATOR)  # (R,)
    live = nxt != SEPARATOR
    nxt, rows = nxt[live], rows[live]
    if nxt.shape[0] == 0:
        return []
    if (nxt == nxt[0]).all():
        return [(int(nxt[0]), int(nxt.shape[0]), rows)]
    values, counts = np.unique(nxt, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return [(int(values[i]), int(counts[i]), rows[nxt == values[i]]) for i in order]


def grow(corpus: np.ndarray, ends: np.ndarray, limit: int, budget: int, max_depth: int, min_prob: float,
         match_len: int = 0) -> TreeProposal:
    """The tree of continuations of the occurrences ending at `ends` (positions in `corpus`; a
    token at index >= `limit` or equal to SEPARATOR ends a continuation), best-first (module
    docstring)."""
    if ends.shape[0] == 0 or budget <= 0 or max_depth <= 0:
        return EMPTY_TREE
    tokens, parents, conf = [], [], []
    heap: list[tuple[float, int, int, int, int, np.ndarray]] = []  # (-confidence, depth, tie, parent, token, rows)
    tie = 0

    def push(parent: int, depth: int, base: float, rows: np.ndarray) -> None:
        nonlocal tie
        for tok, count, sub in _children(corpus, ends, limit, rows, depth):
            heapq.heappush(heap, (-base * count / rows.shape[0], depth, tie, parent, tok, sub))
            tie += 1

    push(-1, 0, 1.0, np.arange(ends.shape[0]))
    while heap and len(tokens) < budget:
        neg, depth, _, parent, tok, rows = heapq.heappop(heap)
        if -neg < min_prob:
            break
        tokens.append(tok), parents.append(parent), conf.append(-neg)
        if depth + 1 < max_depth:
            push(len(tokens) - 1, depth + 1, -neg, rows)
    return TreeProposal(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(conf, np.float64),
                        match_len)


def _paths(tree: TreeProposal) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for t, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((*(out[p] if p >= 0 else ()), t))
    return out


def merge(trees: list[TreeProposal], budget: int) -> TreeProposal:
    """The union of several trees of the same row (the same path in two trees is one node, with
    the larger confidence), its `budget` most confident nodes, best-first (a child is never
    more confident than its parent in any tree, so neither in the union)."""
    trees = [t for t in trees if len(t)]
    if len(trees) <= 1:
        return trees[0] if trees else EMPTY_TREE
    best: dict[tuple[int, ...], float] = {}
    for t in trees:
        for path, c in zip(_paths(t), t.confidence.tolist()):
            if c > best.get(path, -1.0):
                best[path] = c
    kept = sorted(best, key=lambda path: (-best[path], len(path)))[:budget]
    at = {path: i for i, path in enumerate(kept)}
    return TreeProposal(np.asarray([p[-1] for p in kept], np.int64),
                        np.asarray([at[p[:-1]] if len(p) > 1 else -1 for p in kept], np.int64),
                        np.asarray([best[p] for p in kept], np.float64), max(t.match_len for t in trees))
