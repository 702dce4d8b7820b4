"""The token-tree shape of each row, every step (docs/trees.md, issue 28 item 4).

The router picks a row's chain and draft length k; where that chain is a model drafter
straight below the target, this policy picks the tree the target verifies instead of the
chain: a node budget N (N = k: the chain itself) and a width (candidates per depth), from
- the target's measured cost of a forward of n new tokens, T(n) (the router's cost profile:
  the start-up sweep refreshed by every timed forward; interpolated between measured n, never
  extrapolated past the largest), and
- per-rank acceptance evidence: at each depth the main path reached, whether the target's token
  was the drafter's own (rank 0), its r-th alternative, or none (`TreeOutcome.ranks`).

Expected tokens per cycle of a tree (iid per depth, Sequoia's greedy over additive values): a
main-path node at depth d adds p0^(d+1), an alternative of rank r at depth d adds p0^d * p_r;
the best N of these plus the target's own token. A tree is chosen only when its predicted time
per token, (T_draft(k) + T(N + 1)) / E(N), beats the chain's by `margin`; "no speculation" stays
the router's choice. Trees are used for a step of ONE row (single stream): under load the extra
nodes cost every row of the batch, which this policy does not model (the batch keeps chains).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrouter.decoding.executor import StepResult

MAX_NODES = 15  # a verification of n <= 16 new tokens (the profile's largest swept n)


@dataclass
class RankEvidence:
    """Counts of the rank of the target's token at the depths a main path reached (EMA-decayed
    so a change of regime shows), with a prior worth `prior_weight` observations."""

    width: int = 4
    decay: float = 0.995
    prior_weight: float = 8.0
    prior: tuple[float, ...] = (0.5, 0.12, 0.06, 0.04)
    counts: list[float] = field(default_factory=list)  # per rank, and the "none" count last
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0.0] * (self.width + 1)

    def observe(self, ranks: tuple[int, ...]) -> None:
        for r in ranks:
            self.counts = [c * self.decay for c in self.counts]
            self.total = self.total * self.decay + 1
            self.counts[r if 0 <= r < self.width else self.width] += 1

    def rates(self) -> list[float]:
        """p_r, r = 0..width-1: the probability the target's token is the drafter's rank r."""
        w = self.prior_weight
        return [(self.counts[r] + w * (self.prior[r] if r < len(self.prior) else 0.0)) / (self.total + w)
                for r in range(self.width)]


def expected_tokens(rates: list[float], k: int, nodes: int, width: int) -> float:
    """Tokens a cycle commits with the best `nodes` nodes of a main path of k and up to width - 1
    alternatives per depth (module docstring); nodes = k: the chain's."""
    p0 = rates[0]
    values = []
    for d in range(k):
        reach = p0 ** d
        values.append(reach * p0)
        values += [reach * rates[r] for r in range(1, min(width, len(rates)))]
    values.sort(reverse=True)
    return 1.0 + sum(values[:nodes])


class TreePolicy:
    """Chooses (budget, width) per row each step; learns from the step's TreeOutcomes."""

    def __init__(self, target_cost: Callable[[int, int], float], draft_cost: Callable[[str, int], float],
                 drafters: frozenset[str], *, widths: tuple[int, ...] = (2, 3, 4), margin: float = 0.03,
                 max_nodes: int = MAX_NODES):
        self.target_cost = target_cost  # (n new tokens, context L) -> seconds of one row's target forward
        self.draft_cost = draft_cost  # (drafter, context L) -> seconds of one draft step
        self.drafters = drafters  # the model drafters that offer alternatives (not heads, not model-free)
        self.widths, self.margin, self.max_nodes = widths, margin, max_nodes
        self.evidence: dict[tuple[str, bool], RankEvidence] = {}  # (drafter, greedy)
        self.chosen: list[tuple[int, int, int]] = []  # (k, budget, width) of the trees chosen (metrics)

    def _evidence(self, drafter: str, greedy: bool) -> RankEvidence:
        key = (drafter, greedy)
        if key not in self.evidence:
            self.evidence[key] = RankEvidence(width=max(self.widths))
        return self.evidence[key]

    def shape(self, drafter: str, greedy: bool, k: int, context: int) -> tuple[int, int]:
        """(budget, width) for a row drafting k tokens with `drafter`: (0, 1) keeps the chain."""
        if k < 1:
            return 0, 1
        rates = self._evidence(drafter, greedy).rates()
        draft = k * self.draft_cost(drafter, context)

        def t_eff(nodes: int, width: int) -> float:
            return (draft + self.target_cost(nodes + 1, context)) / expected_tokens(rates, k, nodes, width)

        best, best_t = (0, 1), t_eff(k, 1) * (1 - self.margin)
        for width in self.widths:
            for nodes in range(k + 1, min(k * width, self.max_nodes) + 1):
                t = t_eff(nodes, width)
                if t < best_t:
                    best, best_t = (nodes, width), t
        return best

    def shapes(self, rows: list, plans: list[tuple[tuple[str, ...], int]]) -> list[tuple[int, int]] | None:
        """Per row (budget, width), or None: no row gets a tree (several rows: see the docstring)."""
        if len(rows) != 1:
            return None
        (chain, k), seq = plans[0], rows[0]
        if len(chain) != 2 or chain[0] not in self.drafters:
            return None
        k = int(k)
        shape = self.shape(chain[0], seq.params.greedy, k, len(seq.tokens))
        if shape[0]:
            self.chosen.append((k, *shape))
        return [shape]

    def observe(self, result: StepResult, rows: list) -> None:
        greedy = {s.seq_id: s.params.greedy for s in rows}
        chains = {o.seq_id: o.chain for o in result.outcomes}
        for t in result.trees:
            if chains[t.seq_id][0] in self.drafters:
                self._evidence(chains[t.seq_id][0], greedy[t.seq_id]).observe(t.ranks)


class FixedTreeShape:
    """The same (budget, width) for every row a tree can serve, any batch (tests and the
    acceptance benchmark: trees at a pinned shape beside chains)."""

    def __init__(self, budget: int, width: int, rows: Callable[[object], bool] | None = None):
        self.budget, self.width = budget, width
        self.rows = rows  # which rows (Sequence -> bool) get the tree; None: all
        self.outcomes: list = []  # every TreeOutcome seen

    def shapes(self, rows: list, plans: list[tuple[tuple[str, ...], int]]) -> list[tuple[int, int]]:
        return [(self.budget, self.width) if self.rows is None or self.rows(s) else (0, 1) for s in rows]

    def observe(self, result: StepResult, rows: list) -> None:
        self.outcomes += result.trees
