"""The token-tree shape of each row, every step (docs/trees.md, issue 28 item 4).

The router picks a row's chain and draft length k; where that chain is a model drafter
straight below the target, this policy picks the tree the drafter grows and the target
verifies instead of the chain (decoding/tree_drafting.py): its depth D, width W (nodes expanded
per depth), children per expanded node C (W, or more: they cost no draft forward) and node
budget N (at most the target's largest swept n - 1, `from_profile`), from
- measured costs: the target's forward of n new tokens T(n) and the drafter's forward of n
  tokens (the router's cost profile: the start-up sweep refreshed by every timed forward;
  interpolated between measured n, never extrapolated past the largest), and the engine's host
  time per draft depth, measured here from the steps' wall time minus their forwards (a tree's
  drafting does more Python per depth than a chain's step);
- per-depth, per-rank acceptance evidence: at the root and each accepted node the drafter
  expanded, the rank of the target's token among its children (`TreeOutcome.ranks`).

Expected tokens per cycle of a shape (iid given depth, EAGLE-2's growth replayed on expected
values): the root's C children at depth 0 are worth p_r(0); at each depth the W best nodes are
expanded, a child of rank r < C of a node worth v is worth v * p_r(d); the N best nodes plus the
target's own token. W = C = 1, N = D is the chain. Time per cycle: the drafter's D forwards (the
first over its pending tokens, the others over the frontier and its ancestors, at most W * d
tokens), D host steps, and T(N + 1). A tree is chosen only when its time per token beats the
chain's (the router's k) by `margin`; "no speculation" stays the router's choice. Trees are used
for a step of ONE row (single stream): under load the extra nodes cost every row of the batch,
which this policy does not model (the batch keeps chains).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrouter.decoding.executor import StepResult

MAX_NODES = 15  # without a profile: a verification of n <= 16 new tokens (the default sweep's largest n)
MAX_DEPTH = 8
DEPTH_BUCKETS = 4  # evidence per depth 0, 1, 2, 3 and deeper
UNKNOWN = -2  # a rank evidence entry: not the drafter's first child, which one unknown


@dataclass
class RankEvidence:
    """Counts of the rank of the target's token among a drafter's children, per depth bucket
    (EMA-decayed so a change of regime shows), each depth shrunk towards all depths' rates, and
    those towards a prior worth `prior_weight` observations."""

    width: int = 4
    decay: float = 0.995
    prior_weight: float = 8.0
    # the shipped draft's ranks measured on Zen 4 (docs/trees.md "Deep trees"), ranks 6 and 7 guessed
    prior: tuple[float, ...] = (0.45, 0.095, 0.041, 0.039, 0.029, 0.012, 0.008, 0.006)
    counts: list[list[float]] = field(default_factory=list)  # [depth bucket][rank], "none" last
    totals: list[float] = field(default_factory=list)  # per depth bucket

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [[0.0] * (self.width + 1) for _ in range(DEPTH_BUCKETS)]
            self.totals = [0.0] * DEPTH_BUCKETS

    def observe(self, ranks: tuple[int, ...], offered: int | None = None) -> None:
        """`ranks[d]`: the rank of the target's token among the children at depth d (-1: none of
        the `offered` children (None: `width`); UNKNOWN: not rank 0, which one unknown (a chain's
        rejection)). What is censored (not among the first c, c < width) is shared among ranks
        c.. and none as the current rates at that depth share them: a tree of 4 children per
        node says nothing against ranks 4-7."""
        for d, r in enumerate(ranks):
            b = min(d, DEPTH_BUCKETS - 1)
            share = None
            c = 1 if r == UNKNOWN else (offered if r == -1 and offered is not None and offered < self.width else 0)
            if c:
                p = self.rates(d)
                rest = [*p[c:], max(0.0, 1.0 - sum(p))]
                share = ([x / sum(rest) for x in rest] if sum(rest) > 0
                         else [0.0] * (self.width - c) + [1.0])
            self.counts = [[c * self.decay for c in row] for row in self.counts]
            self.totals = [t * self.decay for t in self.totals]
            self.totals[b] += 1
            if share is not None:
                for i, x in enumerate(share, start=c):
                    self.counts[b][i] += x
            else:
                self.counts[b][r if 0 <= r < self.width else self.width] += 1

    def rates(self, depth: int | None = None) -> list[float]:
        """p_r, r = 0..width-1: the probability the target's token is the drafter's rank-r child
        at `depth` (None: over all depths)."""
        w = self.prior_weight
        every = [(sum(row[r] for row in self.counts) + w * (self.prior[r] if r < len(self.prior) else 0.0))
                 / (sum(self.totals) + w) for r in range(self.width)]
        if depth is None:
            return every
        b = min(depth, DEPTH_BUCKETS - 1)
        return [(self.counts[b][r] + w * every[r]) / (self.totals[b] + w) for r in range(self.width)]


def node_levels(rates: Callable[[int], list[float]], depth: int, width: int,
                children: int | None = None) -> list[list[float]]:
    """Per depth, the expected acceptance of the nodes a tree of this width drafts there,
    `children` (None: `width`) per expanded node (module docstring), best first. A deeper tree
    drafts the same shallower levels."""
    frontier, levels = [1.0], []
    for d in range(depth):
        p = rates(d)[: children or width]
        kids = sorted((v * q for v in frontier for q in p), reverse=True)
        levels.append(kids)
        frontier = kids[:width]
    return levels


def node_values(rates: Callable[[int], list[float]], depth: int, width: int,
                children: int | None = None) -> list[float]:
    """Expected acceptance of every node a tree of this depth and width drafts, best first."""
    return sorted((v for level in node_levels(rates, depth, width, children) for v in level), reverse=True)


def expected_tokens(rates: Callable[[int], list[float]], depth: int, nodes: int, width: int,
                    children: int | None = None) -> float:
    """Tokens a cycle commits verifying the best `nodes` nodes of a tree of this depth and
    width (width 1, nodes = depth: the chain)."""
    return 1.0 + sum(node_values(rates, depth, width, children)[:nodes])


class TreePolicy:
    """Chooses (budget, width, depth, children) per row each step; learns from the steps it sees."""

    def __init__(self, target_cost: Callable[[int, int], float], draft_cost: Callable[[str, int, int], float],
                 drafters: frozenset[str], *, free: frozenset[str] = frozenset(), widths: tuple[int, ...] = (2, 3, 4),
                 children: tuple[int, ...] = (8,), margin: float = 0.10, max_nodes: int = MAX_NODES,
                 max_depth: int = MAX_DEPTH, refresh: int = 16, sampled: bool = True):
        self.target_cost = target_cost  # (n new tokens, context L) -> seconds of one row's target forward
        self.draft_cost = draft_cost  # (drafter, n new tokens, context L) -> seconds of one drafter forward
        self.drafters = drafters  # the model drafters that grow trees (not heads, not model-free)
        self.sampled = sampled  # sampled rows may get trees too (EngineConfig.trees "on"; "greedy": not)
        self.free = free  # the model-free drafters that propose trees (`prune`)
        self.widths, self.margin, self.max_nodes, self.max_depth = widths, margin, max_nodes, max_depth
        # children per expanded node searched besides the width (more children cost no draft
        # forward: decoding/tree_drafting.py; the verification's nodes are the budget's)
        self.children = children
        self.evidence: dict[tuple[str, bool], RankEvidence] = {}  # (drafter, greedy)
        # host seconds per draft depth (a step's wall time minus its forwards, over its depths),
        # EMA: chain steps and tree steps (a tree's Python per depth is more); priors until seen
        # (a model-free drafter's cycles: host seconds per cycle, its chains and trees apart)
        self.host = {"chain": 3e-4, "tree": 6e-4, "free-chain": 3e-4, "free-tree": 6e-4}
        # (expected, committed) tokens per cycle, decayed sums, chains and trees apart: the
        # calibration of the expected tokens; the step in flight's (seq_id, kind, expected)
        self.realized = {kind: (0.0, 0.0) for kind in self.host}
        self._costs: dict[int, tuple[int, list[float]]] = {}  # context / 64 -> (step, T(n) for n = 0..max + 1)
        self._expected: tuple[int, str, float] | None = None
        self.refresh = refresh  # steps a decision is reused for (the same drafter, mode, k, context)
        self._cache: dict[tuple, tuple[int, tuple[int, int, int]]] = {}
        self._searched: dict[tuple, tuple] = {}  # (drafter, greedy, context bucket) -> _search's result
        self._steps = 0
        self.chosen: list[tuple[int, int, int, int]] = []  # (k, budget, width, depth) of the trees chosen (metrics)

    @classmethod
    def from_profile(cls, profile, target: str, drafters: frozenset[str], **kwargs) -> "TreePolicy":
        """Priced by a router's cost profile (router/profile.py, one row's forwards): the node
        budget's cap follows the target's largest swept n (N + 1 <= n: T(N + 1) measured, never
        extrapolated; the sweep widens to n = 32 only where such a forward is cheap)."""
        kwargs.setdefault("max_nodes", profile.max_new_tokens(target) - 1)
        return cls(lambda n, L: profile.predict(target, 1, n, L), lambda d, n, L: profile.predict(d, 1, n, L),
                   drafters, **kwargs)

    def _evidence(self, drafter: str, greedy: bool) -> RankEvidence:
        key = (drafter, greedy)
        if key not in self.evidence:
            self.evidence[key] = RankEvidence(width=max(*self.widths, *self.children))
        return self.evidence[key]

    def shape(self, drafter: str, greedy: bool, k: int, context: int) -> tuple[int, int, int]:
        """(budget, width, depth, children) for a row the router gave `drafter` with draft length
        k; (0, 1, k) keeps the chain."""
        return self._decide(drafter, greedy, k, context, fresh=True)[0]

    def _calibration(self, kind: str) -> float:
        """Tokens committed over tokens predicted by `expected_tokens`, for chains or trees
        (decayed sums, a prior of 1 worth a few cycles): the iid model's bias, measured."""
        predicted, committed = self.realized[kind]
        return (committed + 10.0) / (predicted + 10.0)

    def _decide(self, drafter: str, greedy: bool, k: int, context: int,
                fresh: bool = False) -> tuple[tuple[int, int, int], float]:
        """The shape and the tokens per cycle `expected_tokens` gives it (uncalibrated): the
        best tree (`_search`; `fresh`: searched now) when it beats the chain of k by `margin`,
        else the chain."""
        if k < 1:
            return (0, 1, k), 1.0
        rates = self._evidence(drafter, greedy).rates
        t_target, t_draft, tree, tree_e, tree_raw = self._search(drafter, greedy, context, fresh)
        chain_k = min(k, self.max_nodes)
        chain_e = expected_tokens(rates, chain_k, chain_k, 1)
        chain_t = ((chain_k * (t_draft[1] + self.host["chain"]) + t_target[chain_k + 1])
                   / (chain_e * self._calibration("chain")))
        if tree is not None and tree_raw / self._calibration("tree") < chain_t * (1 - self.margin):
            return tree, tree_e
        return (0, 1, k), chain_e

    def _search(self, drafter: str, greedy: bool, context: int, fresh: bool = False):
        """(T_target(n), T_draft(n), the best tree, its expected tokens, its seconds per expected
        token before calibration) for a drafter, mode and context bucket, reused `refresh` steps.
        None of it depends on the chain's k, and the calibration is one factor over every tree,
        so the argmin over trees does not depend on it either: searched once for every k (a k
        change used to search again, ~1 ms; 0.12 ms per speculative step on the mixed stream)."""
        key = (drafter, greedy, context // 64)
        hit = self._searched.get(key)
        if hit is not None and self._steps - hit[0] < self.refresh and not fresh:
            return hit[1:]
        per_bucket = [self._evidence(drafter, greedy).rates(d) for d in range(DEPTH_BUCKETS)]
        rates = lambda d: per_bucket[min(d, DEPTH_BUCKETS - 1)]  # noqa: E731  (rates() is the search's hot spot)
        t_target = [0.0] + [self.target_cost(n, context) for n in range(1, self.max_nodes + 2)]
        t_draft = {n: self.draft_cost(drafter, n, context) for n in {1, 2, *(w * d for w in self.widths
                                                                          for d in range(1, self.max_depth))}}
        best, best_e, best_raw = None, 1.0, float("inf")
        for width in self.widths:
            for kids in sorted({width, *(c for c in self.children if c > width)}):
                levels, values = node_levels(rates, self.max_depth, width, kids), []
                for depth in range(2, self.max_depth + 1):
                    draft = t_draft[2] + sum(t_draft[width * d] for d in range(1, depth)) + depth * self.host["tree"]
                    values = sorted(values + levels[depth - 1] + (levels[0] if depth == 2 else []), reverse=True)
                    gain = 1.0
                    for nodes in range(1, min(len(values), self.max_nodes) + 1):
                        gain += values[nodes - 1]
                        if nodes <= depth:
                            continue
                        raw = (draft + t_target[nodes + 1]) / gain
                        if raw < best_raw:
                            best, best_e, best_raw = (nodes, width, depth, kids), gain, raw
        self._searched[key] = (self._steps, t_target, t_draft, best, best_e, best_raw)
        return t_target, t_draft, best, best_e, best_raw

    def shapes(self, rows: list, plans: list[tuple[tuple[str, ...], int]]) -> list[tuple[int, int, int]] | None:
        """Per row (budget, width, depth[, children]), or None: no row gets a tree (several rows: see the
        module docstring). A model-free drafter's row is offered `max_nodes` nodes k deep (its
        proposal is pruned by `prune`)."""
        self._steps += 1
        if len(rows) != 1:
            return None
        (chain, k), seq = plans[0], rows[0]
        if not self.sampled and not seq.params.greedy:
            return None
        if len(chain) == 2 and chain[0] in self.free and k >= 1:
            return [(self.max_nodes, 1, int(k))]
        if len(chain) != 2 or chain[0] not in self.drafters:
            return None
        k = int(k)
        key = (chain[0], seq.params.greedy, k, len(seq.tokens) // 64)
        hit = self._cache.get(key)
        if hit is None or self._steps - hit[0] >= self.refresh:
            hit = (self._steps, *self._decide(chain[0], seq.params.greedy, k, len(seq.tokens)))
            self._cache[key] = hit
        _, shape, expected = hit
        self._expected = (seq.seq_id, "tree" if shape[0] else "chain", expected)
        if shape[0]:
            self.chosen.append((k, *shape))
        return [shape]

    def _target_costs(self, context: int) -> list[float]:
        """T(n) for n = 0..max_nodes + 1 at this context (reused for `refresh` steps per context / 64)."""
        hit = self._costs.get(context // 64)
        if hit is None or self._steps - hit[0] >= self.refresh:
            hit = (self._steps, [0.0] + [self.target_cost(n, context) for n in range(1, self.max_nodes + 2)])
            self._costs[context // 64] = hit
        return hit[1]

    def prune(self, row, proposal) -> int:
        """How many of a model-free drafter's tree nodes (drafters/trees.py `TreeProposal`,
        best-first) row `row` (the executor's RowWork) verifies: the n most confident nodes,
        for the n with the least time per token, (T(n + 1) + host) / (1 + sum of their
        confidences), both calibrated by what such cycles committed, if that beats the chain (its
        main path, priced the same way) by `margin`; else 0: the chain."""
        conf = proposal.confidence.tolist()
        main = proposal.main_path()
        T = self._target_costs(row.start)
        chain_e = 1.0 + sum(conf[i] for i in main)
        chain_t = (T[len(main) + 1] + self.host["free-chain"]) / (chain_e * self._calibration("free-chain"))
        best, best_e, best_t = 0, chain_e, chain_t * (1 - self.margin)
        c_tree, gain, on_main, chain_so_far = self._calibration("free-tree"), 1.0, set(main), True
        for n in range(1, min(len(conf), self.max_nodes) + 1):
            gain += conf[n - 1]
            chain_so_far = chain_so_far and n - 1 in on_main
            if chain_so_far:
                continue  # main-path nodes only: a chain
            t = (T[n + 1] + self.host["free-tree"]) / (gain * c_tree)
            if t < best_t:
                best, best_e, best_t = n, gain, t
        self._expected = (row.seq.seq_id, "free-tree" if best else "free-chain", best_e)
        if best:
            self.chosen.append((row.k, best, 1, max(1, len(main))))
        return best

    def _observe_free(self, result: StepResult) -> None:
        """A single stream's model-free cycle: its host seconds and committed tokens against
        those `prune` expected."""
        expected, self._expected = self._expected, None
        o = result.outcomes[0]
        kind = "free-tree" if result.trees else "free-chain"
        host = max(0.0, result.wall_time - sum(result.forward_time.values()))
        self.host[kind] = 0.9 * self.host[kind] + 0.1 * host
        if expected is not None and expected[0] == o.seq_id and expected[1] == kind:
            committed = (result.trees[0].accepted if result.trees else o.accepted[1]) + 1
            p, c = self.realized[kind]
            self.realized[kind] = (0.98 * p + expected[2], 0.98 * c + committed)

    def observe(self, result: StepResult, rows: list) -> None:
        """Learn from a step: rank evidence of its trees, and of its chains of a model drafter
        (accepted drafts: rank 0; the first rejected: UNKNOWN); in a single stream, the host
        time per depth and the committed tokens against the expected ones (calibration)."""
        greedy = {s.seq_id: s.params.greedy for s in rows}
        trees = {t.seq_id: t for t in result.trees}
        for o in result.outcomes:
            if len(o.chain) != 2 or o.chain[0] not in self.drafters or o.k < 1:
                continue
            t = trees.get(o.seq_id)
            if t is not None:
                ranks, offered = t.ranks, t.children or t.width
            else:
                ranks, offered = (0,) * o.accepted[1] + ((UNKNOWN,) if o.accepted[1] < o.drafted[1] else ()), None
            self._evidence(o.chain[0], greedy[o.seq_id]).observe(ranks, offered)
        if len(result.outcomes) == 1 and result.outcomes[0].k >= 1 and len(result.outcomes[0].chain) == 2 \
                and result.outcomes[0].chain[0] in self.free:
            return self._observe_free(result)
        expected, self._expected = self._expected, None
        if len(result.outcomes) != 1 or result.outcomes[0].k < 1 or result.outcomes[0].chain[0] not in self.drafters:
            return
        o = result.outcomes[0]
        kind = "tree" if result.trees else "chain"
        host = max(0.0, result.wall_time - sum(result.forward_time.values()))
        self.host[kind] = 0.9 * self.host[kind] + 0.1 * host / o.k
        if expected is not None and expected[0] == o.seq_id and expected[1] == kind and len(o.chain) == 2:
            committed = (result.trees[0].accepted if result.trees else o.accepted[1]) + 1
            p, c = self.realized[kind]
            self.realized[kind] = (0.98 * p + expected[2], 0.98 * c + committed)


class FixedTreeShape:
    """The same (budget, width[, depth[, children]]) for every row a tree can serve, any batch
    (depth None: the row's k; children None: the width; tests and the acceptance benchmark: trees
    at a pinned shape beside chains)."""

    def __init__(self, budget: int, width: int, rows: Callable[[object], bool] | None = None,
                 depth: int | None = None, children: int | None = None):
        self.budget, self.width, self.depth, self.children = budget, width, depth, children
        self.rows = rows  # which rows (Sequence -> bool) get the tree; None: all
        self.outcomes: list = []  # every TreeOutcome seen

    def shapes(self, rows: list, plans: list[tuple[tuple[str, ...], int]]) -> list[tuple[int, ...]]:
        shape = (self.budget, self.width) if self.depth is None else (self.budget, self.width, self.depth)
        if self.children is not None:
            shape = (*shape[:2], shape[2] if len(shape) > 2 else None, self.children)
        return [shape if self.rows is None or self.rows(s) else (0, 1) for s in rows]

    def prune(self, row, proposal) -> int:
        """A model-free drafter's tree is verified whole (all its `budget` nodes)."""
        return len(proposal)

    def observe(self, result: StepResult, rows: list) -> None:
        self.outcomes += result.trees
