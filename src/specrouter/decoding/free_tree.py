"""A model-free drafter's token tree inside one executor step (docs/trees.md "Suffix trees").

The suffix drafter proposes every continuation its match saw, weighted by frequency, best-first
(drafters/trees.py `TreeProposal`); the row's `prune` (the engine's tree policy) keeps the nodes
worth their measured verification cost. What is kept is a tree the target verifies in one forward
(executor `_verify_trees`, exact by construction: decoding/tree.py), or, when only main-path
nodes are worth it, the main path as the row's ordinary chain. No drafter forward: the tree costs
the target's T(n) only.
"""

from __future__ import annotations

from specrouter.decoding.tree import TokenTree, path_independent


def free_tree_ok(ex, w, budget: int, depth: int) -> bool:
    """Row w (the executor `ex`'s RowWork) may verify a model-free drafter's tree: the drafter
    offers trees, straight below the target, which runs them, with room for the nodes side by
    side; no history-dependent processor, grammar or logprobs (their history is the path: one
    per branch; as the executor's `_tree_ok`)."""
    if not (budget > 0 and depth > 0 and len(w.chain) == 2 and w.chain[0] in ex.drafters
            and ex.drafters[w.chain[0]].proposes_trees and ex.runners[w.chain[1]].supports_trees):
        return False
    return ex.runners[w.chain[1]].max_len - w.start > budget and path_independent(w.seq)


def take_free_tree(w, prop, prune) -> None:
    """Row w's proposal `prop`, pruned to `prune(w, prop)` nodes (None: all): w.tree (what the
    target verifies), its main path as w.cand; or, when the nodes kept form a chain (or none
    are), the main path as the row's chain (w.tree None, w.tree_budget 0)."""
    main = prop.main_path()
    keep = len(prop) if prune is None else prune(w, prop)
    tree = TokenTree(tuple(prop.tokens[:keep].tolist()), tuple(prop.parents[:keep].tolist()))
    if keep == 0 or tree.is_chain:  # the chain: the main path, as the drafter would propose it
        w.cand, w.tree_budget = [int(prop.tokens[i]) for i in main], 0
    else:
        w.tree, w.tree_ids = tree, list(range(keep))
        w.cand = [tree.tokens[i] for i in main if i < keep]
    w.drafted[0] = len(w.cand)
