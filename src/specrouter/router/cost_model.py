"""The router's cost model: expected latency, expected committed tokens and T_eff of a chain,
computed exactly by dynamic programming over lengths (docs/design.md, Pillar 1). Pure functions.

One cycle of chain C = [M1, ..., MN] (MN = the target) with draft length k:

1. M1 drafts. A model drafter runs k sequential 1-token forwards (the first one may also carry
   `draft_catchup` pending tokens it has not seen yet) and proposes n_2 = k candidates. A
   model-free drafter (`ModelFreeDraft`, n-gram / prompt lookup) costs `cost(k)` and proposes
   k candidates with probability `hit_rate`, none otherwise (n_2 = 0: level 2 then just takes
   one plain step).
2. Level j = 2..N receives n_j candidates and runs ONE forward over n_j + 1 positions (its
   pending last token plus the candidates), costing cost_j(n_j + 1). It accepts the candidates
   in order, each with probability alpha_j (iid, the acceptance of level j-1's tokens by level
   j), up to the first rejection: a_j is truncated-geometric on 0..n_j,
   P(a_j = i) = alpha_j^i (1 - alpha_j) for i < n_j and P(a_j = n_j) = alpha_j^n_j.
   It passes up its accepted tokens plus one recovered/bonus token: n_{j+1} = a_j + 1.
   Every level can add one token, so n_j <= k + j - 2.
3. The target commits n_{N+1} = a_N + 1 tokens.
4. Confirmed tokens (optional, `alphas[(M1, M2, M3)]`): what level 2 passes to level 3 is the
   candidates it accepted (M1 proposed them AND M2 agreed: easy tokens, often copied text) and
   one token of its own. Level 3 accepts the confirmed ones with their own probability beta
   (the acceptance of M2's tokens by M3 where M1 proposed them too) and M2's own token with
   alpha_3: P(a_3 = i) = beta^i (1 - beta) for i < n_3 - 1, beta^(n_3 - 1) (1 - alpha_3) for
   i = n_3 - 1, beta^(n_3 - 1) alpha_3 for i = n_3. Without the key, beta = alpha_3 (iid). On the
   mixed stream at t=0.7 the iid model predicted 1.47 tokens per cycle for ngram/suffix >
   draft > target where 1.95 came: tokens an n-gram and the draft agree on are ones the target
   agrees on far more often than on the draft's own.

   (A point 5, runs of agreement, priced a request's next cycle by its current run of accepted
   tokens: `RouterConfig.burst_acceptance`, off, removed by prune22, issue 27.)

E[latency] = draft cost + sum_j E[cost_j(n_j + 1)] + overhead,  E[committed] = E[n_{N+1}],
T_eff(C, k) = E[latency] / E[committed]. The distribution of n_j over all draft lengths
k = 1..k_max is one (k_max, W) matrix per level, W = k_max + N, and one level is a matrix
product with the (W, W) transition matrix of its acceptance, so a chain costs N - 1 small
matmuls for every k at once.

Choices the paper leaves open:
- `overhead` (Python/bookkeeping seconds per cycle) is charged to speculative chains only;
  the chain (target,) is plain decoding, T_eff = cost_N(1), whose own per-step overhead is part
  of the measured cost_N(1). It never depends on k; a Plan reports it with k = 0.
- `draft_step_overhead` (host seconds per draft step outside its forward: building the step's
  batch, choosing its tokens, reading them back; on a GPU one sync per step) is charged to each
  of a model drafter's k - 1 steps after its first forward (whose host work is the cycle's), so
  a long draft pays for its steps; a model-free drafter's `cost(k)` is its whole proposal.
- Cost profiles T_M(b, t, L) enter as functions of t alone: the caller builds them for the
  current batch size and context length. A row with logits processors (penalties etc.) pays
  their measured seconds once per forward it takes part in (`processor_costs`): they run on
  the host per forward over the row's positions, so a model drafter's k steps pay k times.
- Ties between plans go to the earlier candidate, then to the smaller k; `enumerate_chains`
  lists (target,) first, so a tie with plain decoding picks plain decoding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Collection, Mapping, Sequence, Union

import numpy as np

from specrouter.config import MAX_DRAFT_LENGTH
from specrouter.errors import ChainError
from specrouter.router.plan_table import PlanTable

# Seconds of one forward of a model over t new tokens: a number (the same for every t), a
# callable t -> seconds, or an array-like indexed by t (entry 0 unused).
CostSpec = Union[float, Callable[[int], float], Sequence[float], np.ndarray]


@dataclass(frozen=True)
class ModelFreeDraft:
    """Cost model of a model-free drafter (n-gram / prompt lookup). Only valid as level 1."""

    cost: float | Callable[[int], float] | np.ndarray = 0.0  # seconds to propose up to k tokens: constant, k -> seconds, or an array indexed by k
    hit_rate: float = 1.0  # probability the lookup proposes k tokens; otherwise it proposes none

    def __post_init__(self) -> None:
        if isinstance(self.cost, np.ndarray):
            if self.cost.ndim != 1 or not _finite_nonnegative(self.cost):
                raise ValueError("ModelFreeDraft.cost as an array must be 1-D, finite and >= 0")
        elif not callable(self.cost):
            _check_seconds("ModelFreeDraft.cost", self.cost)
        _check_probability("ModelFreeDraft.hit_rate", self.hit_rate)

    def costs(self, ks: np.ndarray) -> np.ndarray:
        """(K,) seconds of proposing for each draft length in `ks`."""
        if isinstance(self.cost, np.ndarray):
            if int(ks.max()) >= len(self.cost):
                raise ValueError(f"ModelFreeDraft.cost covers k < {len(self.cost)}, asked up to {int(ks.max())}")
            return self.cost[ks].astype(np.float64, copy=False)  # (fancy indexing made a copy)
        if callable(self.cost):
            out = np.array([float(self.cost(int(k))) for k in ks])
            if not _finite_nonnegative(out):
                raise ValueError(f"ModelFreeDraft.cost(k) must be finite and >= 0, got {out}")
            return out
        return np.full(len(ks), float(self.cost))


@dataclass(frozen=True)
class Plan:
    """The router's decision for the next cycle: the argmin of T_eff over chains and k."""

    chain: tuple[str, ...]  # model names, drafter first, target last
    k: int  # draft length of the drafter; 0 for the target-only chain (plain decoding)
    t_eff: float  # predicted seconds per committed target token
    expected_tokens: float  # expected target tokens committed per cycle
    expected_latency: float  # expected seconds per cycle (overhead included)
    table: PlanTable | None = field(default=None, repr=False, compare=False)  # all candidates


# ---------------------------------------------------------------------------------------------
# validation


def _finite_nonnegative(a: np.ndarray) -> bool:
    """Every entry finite and >= 0 (NaN fails: its comparisons are false): two reductions, not
    the four temporaries of `np.all(np.isfinite(a)) and np.all(a >= 0)` (the router validates
    its cost rows at every decision)."""
    return a.size == 0 or bool(_MIN(a) >= 0.0 and math.isfinite(_MAX(a)))


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # (without ndarray.min's Python wrapper)


def _check_probability(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def _check_int(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ChainError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_chain(chain_costs: Sequence, alphas: Sequence[float]) -> None:
    if len(chain_costs) < 1:
        raise ChainError("a chain needs at least one level (the target)")
    if len(alphas) != len(chain_costs) - 1:
        raise ChainError(
            f"a chain of {len(chain_costs)} levels needs {len(chain_costs) - 1} acceptance "
            f"probabilities (one per drafter/verifier pair), got {len(alphas)}"
        )
    for j, cost in enumerate(chain_costs):
        if isinstance(cost, ModelFreeDraft) and (j != 0 or len(chain_costs) == 1):
            raise ChainError("a model-free drafter can only be level 1 of a chain of >= 2 levels")
    for j, alpha in enumerate(alphas):
        _check_probability(f"alphas[{j}]", alpha)


# ---------------------------------------------------------------------------------------------
# building blocks


def cost_table(cost: CostSpec, t_max: int) -> np.ndarray:
    """(t_max + 1,) float64: seconds of a forward over t new tokens at index t = 1..t_max
    (index 0 is 0). `cost` is a CostSpec; an array-like must cover t = 1..t_max."""
    if callable(cost):
        table = np.array([0.0] + [float(cost(t)) for t in range(1, t_max + 1)])
    elif isinstance(cost, (int, float, np.floating)) and not isinstance(cost, bool):
        table = np.full(t_max + 1, float(cost))
        table[0] = 0.0
    else:
        given = np.asarray(cost, dtype=np.float64)
        if given.ndim != 1 or len(given) < t_max + 1:
            raise ValueError(
                f"a cost table is indexed by the number of new tokens t (entry 0 unused) and must "
                f"cover t = 1..{t_max}: need length >= {t_max + 1}, got shape {given.shape}"
            )
        table = given[: t_max + 1].copy()
        table[0] = 0.0
    if not _finite_nonnegative(table):
        raise ValueError(f"forward costs must be finite and >= 0 seconds, got {table[1:]}")
    return table


@lru_cache(maxsize=32)
def _transition_geometry(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of the (W, W) transition n -> m = a + 1 (a accepted of n received)."""
    n = np.arange(width)[:, None]  # (W, 1) candidates received
    a = np.arange(width)[None, :] - 1  # (1, W) accepted, for next length m = a + 1
    rejected = ((a >= 0) & (a < n)).astype(np.float64)  # (W, W) stopped by a rejection at a
    all_accepted = (a == n).astype(np.float64)  # (W, W) all n accepted (the bonus case)
    exponent = np.maximum(a, 0).astype(np.float64)  # (1, W) alpha^a
    return rejected, all_accepted, exponent


@lru_cache(maxsize=1024)
def _transition(alpha: float, width: int) -> np.ndarray:
    """(W, W) read-only: [n, m] = P(a level passes up m tokens | it received n), with iid
    acceptance alpha. The last row (n = W - 1) loses its m = W mass; a DP never reaches it."""
    rejected, all_accepted, exponent = _transition_geometry(width)
    out = np.power(alpha, exponent) * (rejected * (1.0 - alpha) + all_accepted)  # (W, W)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def _confirmed_geometry(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What `_confirmed_transition` reads besides beta and alpha (read-only): the exponent of
    beta per cell, min(a, n - 1) (W, W) float64; where a rejection stops among the confirmed
    tokens (a < n - 1), where at the level below's own token (a == n - 1); the reachable cells."""
    n = np.arange(width)[:, None]  # (W, 1) candidates received
    a = np.arange(width)[None, :] - 1  # (1, W) accepted, for next length m = a + 1
    confirmed = np.maximum(n - 1, 0)  # (W, 1)
    exponent = np.minimum(np.maximum(a, 0), confirmed).astype(np.float64)  # (W, W)
    out = (exponent, a < confirmed, a == n - 1, (a >= 0) & (a <= n) & (n >= 1))
    for x in out:
        x.setflags(write=False)
    return out


@lru_cache(maxsize=1024)
def _confirmed_transition(beta: float, alpha: float, width: int) -> np.ndarray:
    """(W, W) read-only: [n, m] = P(a level passes up m tokens | it received n), the first n - 1
    of them confirmed (accepted each with beta) and the last the level below's own (alpha):
    module docstring, point 4. Equals `_transition(alpha)` when beta == alpha."""
    exponent, stop_confirmed, stop_own, reachable = _confirmed_geometry(width)
    reach = np.power(beta, exponent)  # (W, W) beta^min(a, n-1)
    stop = np.where(stop_confirmed, 1.0 - beta, np.where(stop_own, 1.0 - alpha, alpha))  # (W, W)
    out = np.where(reachable, reach * stop, 0.0)
    out[0] = _transition(alpha, width)[0]  # nothing received: the level's own token
    out.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def _proposed(k_max: int, width: int) -> np.ndarray:
    """(K, W) read-only: row k-1 proposes k candidates (`np.eye(k_max, width, k=1)`)."""
    out = np.eye(k_max, width, k=1)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def _counts(width: int) -> np.ndarray:
    """(W,) read-only float64 0..W-1: the token counts a length distribution is over."""
    out = np.arange(width, dtype=np.float64)
    out.setflags(write=False)
    return out


def _draft_distribution(hit_rate: float, k_max: int, width: int) -> np.ndarray:
    """(K, W): row k-1 is the distribution of n_2 (candidates proposed) for draft length k."""
    dist = hit_rate * _proposed(k_max, width)  # (K, W) k proposed (a new array)
    if hit_rate < 1.0:
        dist[:, 0] = 1.0 - hit_rate  # a miss proposes nothing
    return dist


def _draft_costs(drafter, table: np.ndarray | None, ks: np.ndarray, draft_catchup: int,
                 step_overhead: float = 0.0) -> np.ndarray:
    """(K,) seconds of drafting k tokens for each k in ks."""
    if isinstance(drafter, ModelFreeDraft):
        return drafter.costs(ks)
    # k sequential forwards; the first one also carries the pending catch-up tokens; each later
    # one is a step of its own, with its host work
    return table[1 + draft_catchup] + (ks - 1) * (table[1] + step_overhead)


def _cycle_by_k(
    draft_cost: np.ndarray,  # (K,) seconds of drafting, overhead included
    draft_dist: np.ndarray,  # (K, W) distribution of n_2
    verifier_tables: Sequence[np.ndarray],  # N-1 tables of length >= W + 1
    alphas: Sequence[float],  # N-1 acceptance probabilities
    confirmed: float | None = None,  # beta of level 3's confirmed tokens (module docstring, 4); None: iid
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The DP: (latency (K,), tokens (K,), [dist of n_2, ..., n_N, n_{N+1}], each (K, W))."""
    width = draft_dist.shape[1]
    latency = draft_cost
    dist = draft_dist
    dists = [dist]
    for j, (table, alpha) in enumerate(zip(verifier_tables, alphas)):
        latency = latency + dist @ table[1 : width + 1]  # (K,) E[cost_j(n_j + 1)]
        step = (_confirmed_transition(float(confirmed), float(alpha), width) if j == 1 and confirmed is not None
                else _transition(float(alpha), width))
        dist = dist @ step  # (K, W) distribution of n_{j+1}
        dists.append(dist)
    tokens = dist @ _counts(width)  # (K,) E[n_{N+1}]
    return latency, tokens, dists


# ---------------------------------------------------------------------------------------------
# public API


def with_certain(cost_rows: Mapping[str, np.ndarray], rate: float) -> dict[str, np.ndarray]:
    """Cost rows T_M(t) (arrays indexed by t) of a row whose grammar forces `rate` tokens per
    token a model chooses (decoding/certain_drafts.py): they join the candidates as certain
    drafts, accepted with probability 1 at every level, so a forward that verifies n own
    candidates runs over 1 + n (1 + rate) positions: T'_M(t) = T_M(1 + round((t - 1)(1 + rate))),
    the row's last entry past its end. A certain token is no acceptance trial (the alphas stay
    the drafters' own). The tokens they add are not counted: the rate multiplies every chain's
    committed tokens alike, plain decoding's included (jump forward commits the ones after its
    token), so no decision and no break-even acceptance changes with it."""
    if not rate > 0.0:
        return dict(cost_rows)
    out = {}
    for m, row in cost_rows.items():
        row = np.asarray(row, dtype=np.float64)
        t = np.arange(len(row))
        wide = np.minimum(1 + np.rint((t - 1) * (1.0 + rate)).astype(np.int64), len(row) - 1)
        wide[0] = 0
        out[m] = row[wide]
    return out


def leviathan_expected_tokens(alpha: float, k: int) -> float:
    """Closed form for a 2-level chain (Leviathan et al., 2023): E[committed] =
    (1 - alpha^(k+1)) / (1 - alpha), and k + 1 when alpha = 1."""
    _check_probability("alpha", alpha)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def length_distribution(k: int, alphas: Sequence[float], draft_hit_rate: float = 1.0) -> list[np.ndarray]:
    """Distributions of the lengths through a chain of N = len(alphas) + 1 levels with draft
    length k: [n_2, ..., n_N, n_{N+1}], each an array of length k + N indexed by the count
    (n_j = candidates reaching level j, n_{N+1} = tokens committed). `draft_hit_rate` < 1 models
    a model-free drafter that sometimes proposes nothing. For N = 1 the list is [n_2 = 1 token]."""
    _check_int("k", k, 1)
    _check_probability("draft_hit_rate", draft_hit_rate)
    for j, alpha in enumerate(alphas):
        _check_probability(f"alphas[{j}]", alpha)
    n_levels = len(alphas) + 1
    width = k + n_levels
    if n_levels == 1:
        plain = np.zeros(width)
        plain[1] = 1.0
        return [plain]
    draft_dist = _draft_distribution(draft_hit_rate, k, width)[k - 1 : k]  # (1, W)
    tables = [np.zeros(width + 1)] * len(alphas)
    _, _, dists = _cycle_by_k(np.zeros(1), draft_dist, tables, alphas)
    return [d[0] for d in dists]


def expected_cycle_by_k(
    chain_costs: Sequence[CostSpec | ModelFreeDraft],
    alphas: Sequence[float],
    k_max: int = MAX_DRAFT_LENGTH,
    overhead: float = 0.0,
    draft_catchup: int = 0,
    draft_step_overhead: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(expected_latency, expected_tokens), each (k_max,), entry k-1 for draft length k.

    chain_costs: one CostSpec per level M1..MN (M1 may be a ModelFreeDraft); alphas[j-2] is the
    acceptance of level j-1's tokens by level j (j = 2..N). overhead: seconds per speculative
    cycle. draft_catchup: pending tokens the drafter's first forward also carries.
    draft_step_overhead: host seconds per model draft step after the first."""
    _check_chain(chain_costs, alphas)
    _check_int("k_max", k_max, 1)
    _check_int("draft_catchup", draft_catchup, 0)
    _check_seconds("overhead", overhead)
    _check_seconds("draft_step_overhead", draft_step_overhead)
    if len(chain_costs) == 1:  # plain decoding: one token per target step, whatever k
        step = cost_table(chain_costs[0], 1)[1]
        return np.full(k_max, step), np.ones(k_max)
    width = k_max + len(chain_costs)
    drafter = chain_costs[0]
    ks = np.arange(1, k_max + 1)
    if isinstance(drafter, ModelFreeDraft):
        draft_cost = drafter.costs(ks)
        draft_dist = _draft_distribution(drafter.hit_rate, k_max, width)
    else:
        draft_cost = _draft_costs(drafter, cost_table(drafter, 1 + draft_catchup), ks, draft_catchup,
                                  draft_step_overhead)
        draft_dist = _draft_distribution(1.0, k_max, width)
    tables = [cost_table(c, width) for c in chain_costs[1:]]
    latency, tokens, _ = _cycle_by_k(draft_cost + overhead, draft_dist, tables, alphas)
    return latency, tokens


def expected_cycle(
    chain_costs: Sequence[CostSpec | ModelFreeDraft],
    alphas: Sequence[float],
    k: int,
    overhead: float = 0.0,
    draft_catchup: int = 0,
    draft_step_overhead: float = 0.0,
) -> tuple[float, float]:
    """(expected seconds per cycle, expected target tokens committed per cycle) of one chain at
    draft length k; see `expected_cycle_by_k` for the arguments."""
    _check_int("k", k, 1)
    latency, tokens = expected_cycle_by_k(chain_costs, alphas, k, overhead, draft_catchup, draft_step_overhead)
    return float(latency[k - 1]), float(tokens[k - 1])


def t_eff(
    chain_costs: Sequence[CostSpec | ModelFreeDraft],
    alphas: Sequence[float],
    k: int,
    overhead: float = 0.0,
    draft_catchup: int = 0,
    draft_step_overhead: float = 0.0,
) -> float:
    """Predicted seconds per committed target token: E[latency] / E[committed]."""
    latency, tokens = expected_cycle(chain_costs, alphas, k, overhead, draft_catchup, draft_step_overhead)
    return latency / tokens


def break_even_confidence(verifier_costs: Sequence[np.ndarray], k: int, t_eff: float) -> float:
    """The least probability that one more candidate is accepted for it to pay: a candidate
    widens the forward of every verifier of the chain by one token (their mean extra seconds
    per candidate over 1..k, from cost tables indexed by new tokens t) and, accepted, saves a
    committed token's worth, `t_eff` seconds under the plan. A confidence-sized drafter (suffix)
    stops before its cumulative confidence drops below this."""
    if k < 1 or not (math.isfinite(t_eff) and t_eff > 0):
        return 0.0
    extra = sum((float(c[k + 1]) - float(c[1])) / k for c in verifier_costs)  # seconds per candidate
    return min(1.0, max(0.0, extra / t_eff))


def processor_costs(rows: Mapping[str, np.ndarray], seconds: float, model_free: Collection[str] = ()
                    ) -> dict[str, np.ndarray]:
    """Cost rows T_M(t) of a row with logits processors: every model forward it takes part in
    (t >= 1) costs `seconds` more, the processors' measured seconds per row-forward (a model
    drafter's k steps k times, each verifier once, plain decoding once)."""
    out = {}
    for m, row in rows.items():
        if m not in model_free:
            out[m] = row.copy()
            out[m][1:] += seconds
    return out


def processor_forwards(chain: Sequence[str], k: int, model_free: Collection[str] = ()) -> int:
    """Forwards whose logits a row's processors process in one cycle of (chain, k): each
    model draft step, each verifier, or the one plain step (a model-free drafter's proposal is
    none). With `processor_costs` the DP charges exactly this many times the seconds."""
    if len(chain) == 1 or k == 0:
        return 1
    return (0 if chain[0] in model_free else k) + len(chain) - 1


def enumerate_chains(
    pool_names_by_cost: Sequence[str], target: str, max_levels: int | None = None
) -> list[tuple[str, ...]]:
    """All ordered sub-chains of the pool ending at the target: every subset of the other
    models, kept in the given (increasing cost) order, followed by the target. For a pool of p
    models (target included) that is 2^(p-1) chains, (target,) first, then by depth.
    `max_levels` caps the chain depth (None: no cap)."""
    names = list(pool_names_by_cost)
    if len(set(names)) != len(names):
        raise ChainError(f"duplicate model names in the pool: {names}")
    others = [n for n in names if n != target]
    top = len(others) + 1 if max_levels is None else max_levels
    _check_int("max_levels", top, 1)
    chains = []
    for depth in range(0, min(top - 1, len(others)) + 1):
        chains.extend(combo + (target,) for combo in itertools.combinations(others, depth))
    return chains



def _rows(chains: Sequence[tuple[str, ...]], k_max: int, width: int, tables: Mapping[str, np.ndarray],
          drafts: Mapping[str, tuple[np.ndarray, np.ndarray]], alphas: Mapping,
          prepared: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(latency (C, K), tokens (C, K)) of every chain (the DP of `_cycle_by_k`), all chains at
    once: each level of the DP is one stacked matmul over the chains (a chain shorter than the
    longest is padded at its first levels with free identity levels: x @ I and x + 0 are exact),
    so the router's table costs a few array operations instead of a Python loop of small ones
    per chain and level (about 4x faster; benchmarks/router_replay.py). Stacked matmuls compute
    each chain as the unstacked ones do, bit for bit (`tests/test_cost_model.py`). `tables`: per
    model, its cost table indexed by new tokens (length >= width + 1); `drafts`: per drafter,
    (seconds of drafting k = 1..k_max with the cycle's overhead, n_2's distribution (K, W)).
    `prepared` (`chain_rows`): the drafters' seconds and the verifiers' levels as arranged for
    these chains, kept for the next call on the same costs (they read no estimate)."""
    chains = tuple(chains)
    layout = _layout(chains, width)
    latency = np.empty((len(chains), k_max))
    tokens = np.empty((len(chains), k_max))
    for i, m in layout.plain:  # plain decoding: one token per target step
        latency[i], tokens[i] = tables[m][1], 1.0
    if not layout.spec:
        return latency, tokens
    n = len(layout.spec)
    arranged = prepared.get((chains, width)) if prepared is not None else None
    if arranged is None:
        cost = np.empty((n, k_max))
        verify = np.zeros((layout.levels, n, width))  # level j's seconds at n_j + 1 = 1..W new tokens (0: a pad level)
        for r, d in enumerate(layout.drafters):
            cost[r] = drafts[d][0]
        for j, r, m, _, _ in layout.cells:
            verify[j, r] = tables[m][1 : width + 1]
        if prepared is not None:
            prepared[(chains, width)] = (cost, verify)  # read, never written: `cost + ...` below is a new array
    else:
        cost, verify = arranged
    dist = np.empty((n, k_max, width))
    for r, d in enumerate(layout.drafters):
        dist[r] = drafts[d][1]
    steps = layout.steps.copy()  # level j's transition n_j -> n_{j+1} (the pad levels' identities set)
    for j, r, m, pair, triple in layout.cells:
        beta = alphas.get(triple) if triple is not None else None
        if beta is None:
            steps[j, r] = _transition(float(alphas[pair]), width)
        else:
            steps[j, r] = _confirmed_transition(float(beta), float(alphas[pair]), width)
    for j in range(layout.levels):
        cost = cost + np.matmul(dist, verify[j][:, :, None])[:, :, 0]  # (n, K) E[cost_j(n_j + 1)]
        dist = np.matmul(dist, steps[j])  # (n, K, W) distribution of n_{j+1}
    latency[layout.spec], tokens[layout.spec] = cost, np.matmul(dist, _counts(width))
    return latency, tokens


@dataclass(frozen=True)
class _Layout:
    """`_rows`' arrangement of a set of chains: which are plain, the speculative ones' drafters,
    verifier levels (the longest chain's), and per (level, chain) its model, pair and triple
    (its confirmed-token key, at level 3 of a chain of >= 3 levels); the transitions' array
    with the pad levels' identities already in place."""

    plain: tuple  # (chain index, its model)
    spec: list  # chain indices of >= 2 levels
    drafters: tuple  # their drafters, in that order
    levels: int
    cells: tuple  # (level, spec row, model, pair, triple or None)
    steps: np.ndarray  # (levels, n, W, W): identities at pad levels (the others overwritten)


@lru_cache(maxsize=256)
def _layout(chains: tuple, width: int) -> _Layout:
    spec = [i for i, c in enumerate(chains) if len(c) > 1]
    levels = max((len(chains[i]) - 1 for i in spec), default=0)
    steps = np.zeros((levels, len(spec), width, width))
    cells = []
    for r, i in enumerate(spec):
        chain = chains[i]
        pad = levels - (len(chain) - 1)
        steps[:pad, r] = _identity(width)
        for j, (m, pair) in enumerate(zip(chain[1:], zip(chain[:-1], chain[1:]))):
            cells.append((pad + j, r, m, pair, chain[:3] if j == 1 else None))
    steps.setflags(write=False)
    return _Layout(tuple((i, c[0]) for i, c in enumerate(chains) if len(c) == 1), spec,
                   tuple(chains[i][0] for i in spec), levels, tuple(cells), steps)


@lru_cache(maxsize=32)
def _identity(width: int) -> np.ndarray:
    """(W, W) read-only identity: a pad level's transition in `_rows`."""
    out = np.eye(width)
    out.setflags(write=False)
    return out


def chain_rows(
    chains: Sequence[tuple[str, ...]],
    k_max: int,
    *,
    costs: Mapping[str, np.ndarray | ModelFreeDraft],
    alphas: Mapping,
    overhead: float = 0.0,
    draft_step_overhead: float = 0.0,
    min_width: int = 0,
    prepared: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(expected_latency (C, K), expected_tokens (C, K)) of `best_plan`'s table, without its
    checks or its argmin: for the router, which evaluates its chains at every decision on cost
    rows (arrays indexed by new tokens) and ModelFreeDrafts checked where they were built, and
    estimates that are probabilities by construction. The same arithmetic as best_plan, bit for
    bit (draft_catchup 0). `prepared`: a dict the caller passes again only with the same costs,
    overheads and width (the router's per published evidence and cost context,
    `EvidenceBoard.chain_rows`): what reads no estimate (the cost tables, the drafters' seconds,
    `_rows`' arrangement of them) is computed once into it, the same arrays a fresh call makes."""
    width = max(k_max + max(len(c) for c in chains), min_width)
    memo = prepared.setdefault(("inputs", k_max, width), {}) if prepared is not None else {}
    ks = np.arange(1, k_max + 1)
    tables: dict[str, np.ndarray] = memo.setdefault("tables", {})
    seconds: dict[str, np.ndarray] = memo.setdefault("seconds", {})  # drafter -> its seconds + overhead
    drafts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for chain in chains:
        for m in chain[1:] if len(chain) > 1 else chain:
            if m not in tables:
                tables[m] = _table_of(costs[m], width)
        d = chain[0]
        if len(chain) > 1 and d not in drafts:
            drafter = costs[d]
            if isinstance(drafter, ModelFreeDraft):
                if d not in seconds:
                    seconds[d] = drafter.costs(ks) + overhead
                drafts[d] = (seconds[d], _draft_distribution(drafter.hit_rate, k_max, width))
            else:
                tables[d] = tables.get(d) if d in tables else _table_of(drafter, width)
                if d not in seconds:
                    seconds[d] = _draft_costs(drafter, tables[d], ks, 0, draft_step_overhead) + overhead
                drafts[d] = (seconds[d], _draft_distribution(1.0, k_max, width))
    return _rows(chains, k_max, width, tables, drafts, alphas, memo if prepared is not None else None)


def _table_of(row: np.ndarray, width: int) -> np.ndarray:
    """`cost_table(row, width)` of a cost row known finite and >= 0: the same copy, unchecked."""
    table = row[: width + 1].copy()
    table[0] = 0.0
    return table


def best_plan(
    candidates: Sequence[Sequence[str]],
    k_max: int = MAX_DRAFT_LENGTH,
    *,
    costs: Mapping[str, CostSpec | ModelFreeDraft],
    alphas: Mapping[tuple[str, str], float],
    overhead: float = 0.0,
    draft_catchup: int = 0,
    draft_step_overhead: float = 0.0,
    min_width: int = 0,
) -> Plan:
    """The (chain, k) of least T_eff over the candidate chains and k = 1..k_max.

    costs: per model name, its CostSpec (forward seconds vs new tokens) or a ModelFreeDraft.
    alphas: per pair (lower level, upper level), the acceptance of the lower one's tokens; and
    optionally per triple (M1, M2, M3), the acceptance of level 2's confirmed tokens by level 3
    (module docstring, point 4; absent: iid).
    overhead: host seconds per speculative cycle; draft_step_overhead: per model draft step
    after the first (module docstring).
    The returned Plan carries the whole PlanTable. Ties go to the earlier candidate, then the
    smaller k. Each model's cost table and each pair's transition matrix are built once.
    min_width: the DP's length axis at least this wide (a caller that evaluates its chains in
    subsets passes the width of the whole set, so a chain's row is the same bits in any subset)."""
    _check_int("k_max", k_max, 1)
    _check_int("draft_catchup", draft_catchup, 0)
    _check_seconds("overhead", overhead)
    _check_seconds("draft_step_overhead", draft_step_overhead)
    chains = tuple(tuple(c) for c in candidates)
    if not chains:
        raise ChainError("best_plan needs at least one candidate chain")
    width = max(k_max + max(len(c) for c in chains), min_width)  # counts 0..k_max+N-1, one width for all
    ks = np.arange(1, k_max + 1)
    tables: dict[str, np.ndarray] = {}

    def table(name: str) -> np.ndarray:
        if name not in tables:
            if name not in costs:
                raise ChainError(f"no cost profile for model {name!r}")
            if isinstance(costs[name], ModelFreeDraft):
                raise ChainError(f"model-free drafter {name!r} can only be level 1 of a chain of >= 2 levels")
            tables[name] = cost_table(costs[name], max(width, 1 + draft_catchup))
        return tables[name]

    drafts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # drafter -> (its seconds + overhead, n_2's distribution)
    for chain in chains:
        if not chain:
            raise ChainError("an empty candidate chain")
        if len(chain) == 1:  # plain decoding
            table(chain[0])
            continue
        try:
            pair_alphas = [alphas[pair] for pair in zip(chain[:-1], chain[1:])]
        except KeyError as err:
            raise ChainError(f"no acceptance estimate for the pair {err.args[0]} of chain {chain}") from None
        drafter = costs.get(chain[0])
        _check_chain([drafter] + [costs.get(n) for n in chain[1:]], pair_alphas)
        for n in chain[1:]:
            table(n)
        if chain[0] not in drafts:  # a drafter's (cost, distribution) serves all its chains
            if isinstance(drafter, ModelFreeDraft):
                drafts[chain[0]] = (drafter.costs(ks) + overhead, _draft_distribution(drafter.hit_rate, k_max, width))
            else:
                drafts[chain[0]] = (_draft_costs(drafter, table(chain[0]), ks, draft_catchup, draft_step_overhead)
                                    + overhead, _draft_distribution(1.0, k_max, width))
    latency, tokens = _rows(chains, k_max, width, tables, drafts, alphas)
    t = latency / tokens  # (C, K)
    i, j = np.unravel_index(int(np.argmin(t)), t.shape)  # first minimum: earlier chain, smaller k
    chain = chains[i]
    return Plan(
        chain=chain,
        k=0 if len(chain) == 1 else int(ks[j]),
        t_eff=float(t[i, j]),
        expected_tokens=float(tokens[i, j]),
        expected_latency=float(latency[i, j]),
        table=PlanTable(chains=chains, ks=ks, t_eff=t, expected_tokens=tokens, expected_latency=latency),
    )
