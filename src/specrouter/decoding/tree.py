"""Token trees: several candidate continuations verified in ONE target forward (SpecInfer,
EAGLE-2, Sequoia), exact by construction. Pure functions over a small frozen `TokenTree`.

Glossary (per row):
- **root**: the row's last committed token (the last pending token of the target's feed); its
  logits give the target's token at the first new position.
- **node** i: a candidate token, child of node `parents[i]` (-1: a child of the root); nodes are
  in topological order (a parent before its children), so a chain is `parents = (-1, 0, 1, ...)`.
- **depth** of node i: its distance from the root minus one (a child of the root: depth 0); it
  stands at sequence position `start + depth` (`start` = the committed length).
- **branch**: the nodes from a child of the root down to a node; the **accepted branch** is the
  longest branch whose every node equals the target's own token at its position.

Why a tree is lossless with our sampling: the target's token at any position is a function of
its prefix only (greedy: the argmax; sampling: counter-based noise keyed by (seed, position),
`decoding/noise.py`), and the runner computes each node's logits bitwise as sequential decoding
of its branch would (runners/base.py `ForwardBatch.parents`). So walking from the root down the
child equal to the target's token (`walk`) commits exactly what plain decoding would produce,
whatever the tree: accepted nodes, then the target's own token (recovered where no child
matches, bonus below a leaf).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenTree:
    """Candidate nodes of one row: tokens and parents, topological order (see module doc)."""

    tokens: tuple[int, ...]  # node i's token
    parents: tuple[int, ...]  # node i's parent node (< i), -1: a child of the root

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} is not an earlier node (or -1)")
        seen = set()
        for t, p in zip(self.tokens, self.parents):
            if (p, t) in seen:
                raise ValueError(f"two children of node {p} carry token {t}")
            seen.add((p, t))

    @staticmethod
    def chain(tokens: list[int]) -> "TokenTree":
        return TokenTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    def branch(self, node: int) -> list[int]:
        """Nodes from a child of the root down to `node`, root side first."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def main_path(self) -> list[int]:
        """The first child of every node from the root down (a drafter that orders children
        best first: the chain it would have proposed)."""
        out, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                out.append(i)
                node = i
        return out

    def truncated(self, n: int) -> "TokenTree":
        """Its first n nodes (still a tree: parents come first)."""
        return TokenTree(self.tokens[:n], self.parents[:n])


def path_independent(seq) -> bool:
    """Sequence `seq` may verify a token tree: nothing of its sampling reads the draft path
    beyond the model's own prefix (no history-dependent logits processor, no grammar: one
    history per branch), and no logprobs asked (they read chain positions)."""
    return not seq.params.has_processors and seq.grammar is None and seq.params.logprobs is None


def feed_parents(num_pending: int, tree: TokenTree) -> list[int]:
    """Parents among the new tokens of a forward feeding `num_pending` pending tokens (a chain,
    the last one the root) then the tree's nodes: what `ForwardBatch.build(parents=...)` takes."""
    root = num_pending - 1
    return [*range(-1, num_pending - 1), *(root if p < 0 else num_pending + p for p in tree.parents)]


def token_offsets(tree: TokenTree) -> list[int]:
    """Per logit of a tree verification (the root, then each node), the offset from `start` of
    the position whose token it gives: 0 for the root, depth + 1 for a node (the sampling noise
    is keyed by that absolute position)."""
    return [0, *(d + 1 for d in tree.depths)]


def walk(tree: TokenTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """The accepted branch and the final token. `target_tokens[0]`: the target's token after the
    root; `target_tokens[1 + i]`: after node i. From the root, move to the child whose token
    equals the target's token there, while one does; then the target's token at the node
    reached is the recovered (or bonus) token. Returns (accepted nodes, root side first; final
    token)."""
    children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))}
    node, accepted = -1, []
    while True:
        tok = target_tokens[node + 1]
        child = children.get((node, tok))
        if child is None:
            return accepted, tok
        accepted.append(child)
        node = child
