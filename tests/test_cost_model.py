"""The router's cost model: the exact DP against a brute-force Monte Carlo simulation of the iid
acceptance model, the Leviathan et al. closed form, and best_plan against hand-made tables."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specrouter.errors import ChainError
from specrouter.router.cost_model import (
    ModelFreeDraft,
    Plan,
    best_plan,
    break_even_confidence,
    chain_rows,
    cost_table,
    enumerate_chains,
    expected_cycle,
    expected_cycle_by_k,
    length_distribution,
    leviathan_expected_tokens,
    t_eff,
)

CYCLES = 200_000


def simulate(chain_costs, alphas, k, seed, overhead=0.0, draft_catchup=0):
    """Brute force: play CYCLES cycles token by token (one uniform draw per candidate)."""
    rng = np.random.default_rng(seed)
    drafter = chain_costs[0]
    if isinstance(drafter, ModelFreeDraft):
        latency = np.full(CYCLES, drafter.costs(np.array([k]))[0])
        n = np.where(rng.random(CYCLES) < drafter.hit_rate, k, 0)
    else:
        latency = np.full(CYCLES, drafter(1 + draft_catchup) + (k - 1) * drafter(1))
        n = np.full(CYCLES, k)
    latency = latency + overhead
    for cost, alpha in zip(chain_costs[1:], alphas):
        by_t = np.array([0.0] + [cost(t) for t in range(1, n.max() + 2)])
        latency = latency + by_t[n + 1]  # one forward over the pending token + n candidates
        width = max(int(n.max()), 1)
        accept = rng.random((CYCLES, width)) < alpha  # (cycles, width) per-candidate coin
        accept &= np.arange(width)[None, :] < n[:, None]  # only the n candidates that arrived
        accepted = np.cumprod(accept, axis=1).sum(axis=1)  # accepted prefix, stops at the first rejection
        n = accepted + 1  # plus the recovered / bonus token
    return latency, n


def flat(c):
    return lambda t: c


def linear(base, per_token):
    return lambda t: base + per_token * t


def convex(base, per_token):
    return lambda t: base + per_token * t + 0.002 * t * t


MC_CASES = [
    # (chain costs M1..MN, alphas, ks)
    ([flat(0.01), flat(1.0)], [0.7], [1, 4, 9]),
    ([linear(0.01, 0.001), linear(0.5, 0.05)], [0.9], [3, 16]),
    ([flat(0.002), linear(0.05, 0.004), convex(0.4, 0.03)], [0.6, 0.8], [2, 5, 12]),
    ([linear(0.002, 0.0), flat(0.05), linear(0.2, 0.02)], [0.95, 0.3], [7]),
    ([flat(0.001), linear(0.01, 0.002), convex(0.08, 0.01), linear(0.9, 0.1)], [0.5, 0.7, 0.85], [3, 8, 16]),
    ([flat(0.001), flat(0.01), flat(0.1), flat(1.0)], [1.0, 0.0, 0.9], [4]),
    ([ModelFreeDraft(cost=0.0005, hit_rate=0.6), linear(0.05, 0.01), linear(0.6, 0.04)], [0.75, 0.8], [1, 6]),
    ([ModelFreeDraft(cost=lambda k: 1e-4 * k, hit_rate=1.0), convex(0.3, 0.05)], [0.4], [5]),
]


@pytest.mark.parametrize("case", range(len(MC_CASES)))
def test_dp_equals_monte_carlo(case):
    chain_costs, alphas, ks = MC_CASES[case]
    for k in ks:
        for overhead, catchup in [(0.0, 0), (0.003, 2)]:
            latency, tokens = expected_cycle(chain_costs, alphas, k, overhead=overhead, draft_catchup=catchup)
            sim_latency, sim_tokens = simulate(chain_costs, alphas, k, seed=1000 * case + k, overhead=overhead, draft_catchup=catchup)
            assert latency == pytest.approx(sim_latency.mean(), rel=0.01)
            assert tokens == pytest.approx(sim_tokens.mean(), rel=0.01)
            assert t_eff(chain_costs, alphas, k, overhead, catchup) == pytest.approx(
                sim_latency.mean() / sim_tokens.mean(), rel=0.01
            )


@pytest.mark.parametrize("alphas", [[0.7], [0.6, 0.9], [0.5, 0.8, 0.95], [1.0, 0.0, 0.5]])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_length_distribution_equals_monte_carlo(alphas, k):
    dists = length_distribution(k, alphas)
    assert len(dists) == len(alphas) + 1
    for d in dists:
        assert d.shape == (k + len(alphas) + 1,) and d.sum() == pytest.approx(1.0) and np.all(d >= 0)
    assert dists[0][k] == 1.0  # n_2 = k
    _, committed = simulate([flat(0.0)] + [flat(0.0)] * len(alphas), alphas, k, seed=k)
    observed = np.bincount(committed, minlength=len(dists[-1])) / CYCLES
    np.testing.assert_allclose(observed, dists[-1], atol=0.005)


def test_length_distribution_model_free_misses():
    dists = length_distribution(4, [0.5], draft_hit_rate=0.25)
    assert dists[0][0] == pytest.approx(0.75) and dists[0][4] == pytest.approx(0.25)
    assert dists[1][1] == pytest.approx(0.75 + 0.25 * 0.5)  # a miss or a first rejection: 1 token


def test_plain_decoding_length_distribution():
    (committed,) = length_distribution(3, [])
    assert committed.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.99, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_two_levels_match_leviathan_closed_form(alpha, k):
    expected = (k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    assert leviathan_expected_tokens(alpha, k) == pytest.approx(expected)
    _, tokens = expected_cycle([1.0, 1.0], [alpha], k)
    assert tokens == pytest.approx(expected, rel=1e-12)
    assert length_distribution(k, [alpha])[-1] @ np.arange(k + 2) == pytest.approx(expected, rel=1e-12)


def test_by_k_equals_single_k_and_latency_closed_form():
    costs = [linear(0.01, 0.001), linear(0.3, 0.02)]
    latency, tokens = expected_cycle_by_k(costs, [0.8], k_max=16, overhead=0.002)
    for k in range(1, 17):
        assert (latency[k - 1], tokens[k - 1]) == pytest.approx(expected_cycle(costs, [0.8], k, overhead=0.002))
        # 2 levels: n_2 = k exactly, so the latency is deterministic
        assert latency[k - 1] == pytest.approx(k * 0.011 + 0.3 + 0.02 * (k + 1) + 0.002)


def test_target_only_is_plain_decoding():
    step = linear(0.2, 0.05)
    assert t_eff([step], [], k=7, overhead=0.01) == pytest.approx(0.25)  # no speculative overhead
    assert expected_cycle([[0.0, 0.25, 0.3]], [], k=3) == (0.25, 1.0)


def test_cost_specs():
    assert cost_table(0.5, 3).tolist() == [0.0, 0.5, 0.5, 0.5]
    assert cost_table(lambda t: t / 10, 3).tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert cost_table([9.0, 1.0, 2.0, 3.0, 4.0], 3).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="cover t = 1..5"):
        cost_table([0.0, 1.0, 2.0], 5)
    with pytest.raises(ValueError, match="finite"):
        cost_table(lambda t: -1.0, 2)


def test_invalid_inputs():
    with pytest.raises(ChainError, match="acceptance"):
        expected_cycle([0.1, 1.0], [], 4)
    with pytest.raises(ValueError, match="probability"):
        expected_cycle([0.1, 1.0], [1.2], 4)
    with pytest.raises(ChainError, match="k must be"):
        expected_cycle([0.1, 1.0], [0.5], 0)
    with pytest.raises(ChainError, match="model-free"):
        expected_cycle([0.1, ModelFreeDraft(), 1.0], [0.5, 0.5], 2)
    with pytest.raises(ValueError, match="hit_rate"):
        ModelFreeDraft(hit_rate=2.0)
    with pytest.raises(ChainError, match="pair"):
        best_plan([("d", "t")], costs={"d": 0.1, "t": 1.0}, alphas={})
    with pytest.raises(ChainError, match="cost profile"):
        best_plan([("x", "t")], costs={"t": 1.0}, alphas={("x", "t"): 0.5})
    with pytest.raises(ChainError, match="model-free"):
        best_plan([("ng",)], costs={"ng": ModelFreeDraft()}, alphas={})


# --- best_plan ---------------------------------------------------------------------------------


def brute_force_plan(candidates, costs, alphas, k_max, overhead=0.0):
    best = None
    for chain in candidates:
        pair_alphas = [alphas[p] for p in zip(chain[:-1], chain[1:])]
        for k in range(1, k_max + 1) if len(chain) > 1 else [1]:
            value = t_eff([costs[n] for n in chain], pair_alphas, k, overhead)
            if best is None or value < best[0] - 1e-15:
                best = (value, tuple(chain), k if len(chain) > 1 else 0)
    return best


def test_useless_draft_gives_plain_decoding():
    plan = best_plan([("t",), ("d", "t")], costs={"d": 0.001, "t": 1.0}, alphas={("d", "t"): 0.0})
    assert isinstance(plan, Plan)
    assert (plan.chain, plan.k, plan.t_eff, plan.expected_tokens) == (("t",), 0, 1.0, 1.0)


def test_perfect_cheap_draft_gives_longest_k():
    plan = best_plan([("t",), ("d", "t")], 16, costs={"d": 0.001, "t": 1.0}, alphas={("d", "t"): 1.0})
    assert (plan.chain, plan.k) == (("d", "t"), 16)
    assert plan.expected_tokens == pytest.approx(17.0)
    assert plan.t_eff == pytest.approx((16 * 0.001 + 1.0) / 17)


def test_best_k_matches_closed_form():
    alpha, c_draft = 0.8, 0.05  # target forward = 1 s whatever t
    closed = [(k * c_draft + 1.0) / leviathan_expected_tokens(alpha, k) for k in range(1, 17)]
    plan = best_plan([("t",), ("d", "t")], costs={"d": c_draft, "t": 1.0}, alphas={("d", "t"): alpha})
    assert plan.k == int(np.argmin(closed)) + 1 and plan.t_eff == pytest.approx(min(closed))
    np.testing.assert_allclose(plan.table.t_eff[1], closed)


def test_draft_step_overhead_is_charged_per_model_draft_step_after_the_first():
    """Host seconds per draft step (issue 33, the GPU's sync per step): k - 1 of them for a model
    drafter of length k, none for a model-free drafter (its cost(k) is the whole proposal), and
    the closed-form optimum k moves down: with the per-step host time, a long draft is dearer."""
    alpha, c_draft, step = 0.8, 0.05, 0.08  # target forward = 1 s whatever t
    costs = [flat(c_draft), flat(1.0)]
    base, tokens = expected_cycle_by_k(costs, [alpha], k_max=16, overhead=0.01)
    charged, same = expected_cycle_by_k(costs, [alpha], k_max=16, overhead=0.01, draft_step_overhead=step)
    np.testing.assert_allclose(charged - base, step * np.arange(16))
    np.testing.assert_allclose(same, tokens)
    assert t_eff(costs, [alpha], 5, overhead=0.01, draft_step_overhead=step) == pytest.approx(charged[4] / tokens[4])
    free = [ModelFreeDraft(cost=0.001, hit_rate=0.5), flat(1.0)]
    assert expected_cycle_by_k(free, [alpha], 8, draft_step_overhead=step)[0] == pytest.approx(
        expected_cycle_by_k(free, [alpha], 8)[0])
    closed = [(k * c_draft + (k - 1) * step + 1.0) / leviathan_expected_tokens(alpha, k) for k in range(1, 17)]
    plan = best_plan([("t",), ("d", "t")], costs={"d": c_draft, "t": 1.0}, alphas={("d", "t"): alpha},
                     draft_step_overhead=step)
    uncharged = best_plan([("t",), ("d", "t")], costs={"d": c_draft, "t": 1.0}, alphas={("d", "t"): alpha})
    assert plan.k == int(np.argmin(closed)) + 1 and plan.t_eff == pytest.approx(min(closed))
    assert plan.k < uncharged.k  # the negative control: without it the draft runs longer
    with pytest.raises(ValueError):
        best_plan([("d", "t")], costs={"d": 0.1, "t": 1.0}, alphas={("d", "t"): 0.5}, draft_step_overhead=-1.0)


def test_best_plan_is_the_true_argmin_on_random_tables():
    rng = np.random.default_rng(7)
    names = ["ngram", "d1", "d2", "d3", "t"]
    chains = enumerate_chains(names, "t")
    for trial in range(20):
        per_token = {"d1": 0.002, "d2": 0.01, "d3": 0.05, "t": 0.1}
        costs = {
            n: linear(rng.uniform(0.2, 1.0) * s * 10, rng.uniform(0.0, 1.0) * s) for n, s in per_token.items()
        }
        costs["ngram"] = ModelFreeDraft(cost=rng.uniform(0, 1e-3), hit_rate=rng.uniform(0.2, 1.0))
        alphas = {(a, b): rng.uniform(0.0, 1.0) for a, b in itertools.combinations(names, 2)}
        overhead = rng.uniform(0.0, 0.01)
        plan = best_plan(chains, 12, costs=costs, alphas=alphas, overhead=overhead)
        value, chain, k = brute_force_plan(chains, costs, alphas, 12, overhead)
        assert (plan.chain, plan.k) == (chain, k) and plan.t_eff == pytest.approx(value, rel=1e-12)
        # the table is consistent with the single-chain functions
        for i, c in enumerate(plan.table.chains):
            for kk in (1, 12):
                lat, tok = expected_cycle(
                    [costs[n] for n in c], [alphas[p] for p in zip(c[:-1], c[1:])], kk, overhead
                ) if len(c) > 1 else (costs[c[0]](1), 1.0)
                assert plan.table.expected_latency[i, kk - 1] == pytest.approx(lat, rel=1e-12)
                assert plan.table.expected_tokens[i, kk - 1] == pytest.approx(tok, rel=1e-12)


def test_chain_rows_are_the_per_chain_dp_bit_for_bit_in_any_subset():
    """The router's table (`chain_rows`: every chain's DP in stacked matmuls, shorter chains
    padded with identity levels) equals, bit for bit, the DP run chain by chain
    (`_cycle_by_k`, what best_plan computed before) and itself over any subset of the chains
    (the router's decision cache reuses rows computed in other subsets), confirmed-token
    triples included; best_plan's table is the same bits."""
    from specrouter.router.cost_model import _cycle_by_k, _draft_costs, _draft_distribution

    rng = np.random.default_rng(11)
    names = ["ngram", "suffix", "d1", "d2", "t"]
    chains = [c for c in enumerate_chains(names, "t") if not any(m in ("ngram", "suffix") for m in c[1:])]
    k_max, width = 16, 16 + max(len(c) for c in chains)
    for trial in range(10):
        costs = {n: np.concatenate([[0.0], np.sort(rng.uniform(0.1, 1.0, 40)) * s])
                 for n, s in (("d1", 0.002), ("d2", 0.01), ("t", 0.1))}
        for d in ("ngram", "suffix"):
            costs[d] = ModelFreeDraft(cost=rng.uniform(0.0, 1e-4, 40), hit_rate=round(rng.uniform(0.1, 1.0), 4))
        alphas = {(a, b): round(rng.uniform(0.0, 1.0), 4) for a, b in itertools.combinations(names, 2)}
        alphas.update({c[:3]: round(rng.uniform(0.0, 1.0), 4) for c in chains if len(c) >= 3 and c[0] in ("ngram", "suffix")})
        overhead, step = rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.001)
        latency, tokens = chain_rows(chains, k_max, costs=costs, alphas=alphas, overhead=overhead,
                                     draft_step_overhead=step, min_width=width)
        plan = best_plan(chains, k_max, costs=costs, alphas=alphas, overhead=overhead, draft_step_overhead=step,
                         min_width=width)
        assert np.array_equal(plan.table.expected_latency, latency) and np.array_equal(plan.table.expected_tokens, tokens)
        ks = np.arange(1, k_max + 1)
        for i, c in enumerate(chains):
            if len(c) == 1:
                assert np.all(latency[i] == costs[c[0]][1]) and np.all(tokens[i] == 1.0)
                continue
            d = costs[c[0]]
            if isinstance(d, ModelFreeDraft):
                draft = (d.costs(ks) + overhead, _draft_distribution(d.hit_rate, k_max, width))
            else:
                draft = (_draft_costs(d, cost_table(d, width), ks, 0, step) + overhead, _draft_distribution(1.0, k_max, width))
            lat, tok, _ = _cycle_by_k(*draft, [cost_table(costs[m], width) for m in c[1:]],
                                      [alphas[p] for p in zip(c[:-1], c[1:])], alphas.get(c[:3]) if len(c) >= 3 else None)
            assert np.array_equal(lat, latency[i]) and np.array_equal(tok, tokens[i]), c
        for subset in ([1, 2], [3], [0, 5, 7], list(range(len(chains)))[::-1][:4]):
            lat, tok = chain_rows([chains[i] for i in subset], k_max, costs=costs, alphas=alphas, overhead=overhead,
                                  draft_step_overhead=step, min_width=width)
            assert np.array_equal(lat, latency[subset]) and np.array_equal(tok, tokens[subset]), subset


def test_scripted_slowdown_switches_chain():
    alphas = {("d", "t"): 0.8}
    fast = best_plan([("t",), ("d", "t")], costs={"d": 0.01, "t": 0.1}, alphas=alphas)
    slow = best_plan([("t",), ("d", "t")], costs={"d": 0.2, "t": 0.1}, alphas=alphas)
    assert fast.chain == ("d", "t") and fast.k >= 2
    assert slow.chain == ("t",) and slow.k == 0


def test_plan_table_format():
    plan = best_plan(
        enumerate_chains(["d", "m", "t"], "t"),
        costs={"d": 0.001, "m": linear(0.01, 0.001), "t": linear(0.1, 0.002)},
        alphas={("d", "m"): 0.9, ("d", "t"): 0.6, ("m", "t"): 0.85},
    )
    text = plan.table.format()
    assert text.count("\n") == 4 and "d -> m -> t" in text and "1.00x" in text


# --- enumerate_chains --------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
def test_enumeration_count(p):
    pool = [f"m{i}" for i in range(p - 1)] + ["target"]
    chains = enumerate_chains(pool, "target")
    assert len(chains) == 2 ** (p - 1) == len(set(chains))
    assert chains[0] == ("target",)
    for chain in chains:
        assert chain[-1] == "target"
        positions = [pool.index(n) for n in chain]
        assert positions == sorted(positions)  # increasing cost order kept


def test_enumeration_details():
    assert enumerate_chains(["a", "b", "t"], "t") == [("t",), ("a", "t"), ("b", "t"), ("a", "b", "t")]
    assert enumerate_chains(["a", "b"], "t") == [("t",), ("a", "t"), ("b", "t"), ("a", "b", "t")]
    assert len(enumerate_chains(["a", "b", "c", "d", "t"], "t", max_levels=3)) == 1 + 4 + 6
    with pytest.raises(ChainError, match="duplicate"):
        enumerate_chains(["a", "a", "t"], "t")


def test_break_even_confidence_is_the_verifiers_extra_seconds_per_candidate_over_t_eff():
    linear = cost_table(lambda t: 0.040 + 0.0025 * t, 12)  # 2.5 ms per extra token
    assert break_even_confidence([linear], 4, 0.025) == pytest.approx(0.1)
    assert break_even_confidence([linear, linear], 4, 0.025) == pytest.approx(0.2)  # both widen
    assert break_even_confidence([linear], 4, 0.0125) == pytest.approx(0.2)  # tokens worth less
    flat = cost_table(0.040, 12)
    assert break_even_confidence([flat], 8, 0.02) == 0.0  # free candidates: draft all k
    convex = cost_table(lambda t: 0.040 + 0.001 * t * t, 12)
    assert break_even_confidence([convex], 8, 0.02) > break_even_confidence([convex], 2, 0.02)  # mean over 1..k
    assert break_even_confidence([linear], 4, 0.001) == 1.0  # clipped: never worth it
    assert break_even_confidence([linear], 0, 0.02) == 0.0
    assert break_even_confidence([linear], 4, float("inf")) == 0.0


@pytest.mark.parametrize("beta,alpha", [(0.9, 0.3), (0.2, 0.7), (0.6, 0.6)])
def test_confirmed_tokens_dp_equals_monte_carlo(beta, alpha):
    """Point 4 of the cost model: level 3 accepts the tokens levels 1 and 2 agreed on with beta
    and level 2's own token with alpha. best_plan with the triple's key equals a brute-force play
    of exactly that; beta == alpha is the iid model; a lower or higher beta moves the tokens."""
    costs = {"ngram": ModelFreeDraft(cost=0.0005, hit_rate=0.7), "d": linear(0.002, 0.0005), "T": linear(0.05, 0.004)}
    chain, a_nd, k = ("ngram", "d", "T"), 0.6, 5
    rng = np.random.default_rng(7)
    n = np.where(rng.random(CYCLES) < 0.7, k, 0)  # ngram proposals
    a2 = np.cumprod((rng.random((CYCLES, k)) < a_nd) & (np.arange(k)[None] < n[:, None]), axis=1).sum(axis=1)
    width = k + 1  # level 3 receives a2 confirmed + 1 own
    p = np.where(np.arange(width)[None] < a2[:, None], beta, alpha)  # (cycles, width)
    accept = (rng.random((CYCLES, width)) < p) & (np.arange(width)[None] <= a2[:, None])
    committed = np.cumprod(accept, axis=1).sum(axis=1) + 1
    alphas = {("ngram", "d"): a_nd, ("d", "T"): alpha}
    plan = best_plan([chain], 8, costs=costs, alphas={**alphas, chain: beta})
    assert plan.table.expected_tokens[0, k - 1] == pytest.approx(committed.mean(), rel=0.01)
    iid = best_plan([chain], 8, costs=costs, alphas=alphas).table.expected_tokens[0, k - 1]
    if beta == alpha:
        assert plan.table.expected_tokens[0, k - 1] == pytest.approx(iid, rel=1e-12)
    else:  # the negative control: the iid model misses the confirmed tokens' own rate
        assert abs(iid - committed.mean()) > 0.05 * committed.mean()
        assert (plan.table.expected_tokens[0, k - 1] > iid) == (beta > alpha)
