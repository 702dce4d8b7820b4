"""Multi-level speculative sampling is lossless: proofs on tiny "table models".

A table model is a bigram table `table[last_token] -> distribution over V` (V = 6), different at
every level, processed with the real `process_logits` (temperature 0.7, top_p 0.9 on the
log-table logits). One cycle: M1 drafts k tokens by `sample`; each level j = 2..N scores the
candidates from its table and calls `verify_speculative`, passing its output up with its probs
as the next proposal distribution; the target's output is what is committed.

What is compared with the target alone:
- the first committed token;
- the first m tokens "completed": the committed tokens, where a token past what this cycle
  committed is drawn from the target directly given the previous ones. Since every committed
  token is, given everything before it, distributed as the target's next-token distribution
  (the length is a stopping time), the completed m tokens must follow the target's own m-token
  joint exactly.
Exactly (enumerating all drafts and accept/reject outcomes with `acceptance_probability` and
`residual_distribution`, float64, 1e-12) and by seeded Monte Carlo (200k draws, TV < 0.01). A
sampler that draws the recovered token from verifier_probs instead of the residual must fail.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from specrouter.config import SamplingParams
from specrouter.decoding import verification
from specrouter.decoding.sampling import SamplingTensors, process_logits, sample
from specrouter.decoding.verification import (
    acceptance_probability,
    residual_distribution,
    verify_speculative,
)

V = 6  # vocabulary of the table models
CTX = 0  # the last context token before the cycle
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
TOP_K = SamplingParams(temperature=0.9, top_k=3)  # at most 3 of the 6 tokens survive
GREEDY = SamplingParams(temperature=0.0)  # processed distributions are one-hot at the argmax
R = 200_000  # Monte Carlo draws (rows of one batched cycle)
TABLE_SEEDS = (121, 221, 321, 421)  # one table per level, M1 first; chosen so the broken sampler is far off
_tables_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def log_table(seed: int) -> torch.Tensor:
    """(V, V) float64 logits = log of a random bigram table, rows ~ Dirichlet(1, ..., 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(V, V, dtype=torch.float64).exponential_(generator=g)  # (V, V)
    return (w / w.sum(-1, keepdim=True)).log()


def processed_table(seed: int, params: SamplingParams = PARAMS) -> torch.Tensor:
    """(V, V): row c = the processed next-token distribution after token c."""
    logits = log_table(seed)[None]  # (1, V, V): one row, V positions (broadcast over the middle)
    return process_logits(logits, SamplingTensors.from_params([params]))[0]


def mixed_tables(num_levels: int, modes: tuple[SamplingParams, ...]) -> list[torch.Tensor]:
    """Per level (M1 first), (M, V, V): the table processed for each of M rows' parameters in
    ONE `process_logits` call over a mixed batch (greedy and sampling rows together)."""
    st = SamplingTensors.from_params(list(modes))
    return [process_logits(log_table(s)[None].expand(len(modes), V, V), st) for s in TABLE_SEEDS[:num_levels]]


def one_hot_guess_table() -> torch.Tensor:
    """A model-free drafter: after token c it always guesses (2c + 1) mod V (one-hot)."""
    guess = (2 * torch.arange(V) + 1) % V
    return torch.nn.functional.one_hot(guess, V).to(torch.float64)


def chain_tables(num_levels: int, one_hot_drafter: bool = False, params: SamplingParams = PARAMS) -> list[torch.Tensor]:
    """Processed tables of a chain, M1 first, target last."""
    tables = [processed_table(s, params) for s in TABLE_SEEDS[:num_levels]]
    if one_hot_drafter:
        tables[0] = one_hot_guess_table()
    return tables


# ----------------------------------------------------------------------------- exact enumeration


def exact_cycle(tables: list[torch.Tensor], k: int, broken: bool = False) -> dict[tuple[int, ...], float]:
    """The exact distribution of the target's output sequence of one cycle, by enumerating all
    drafts and every accept/reject outcome at every level."""
    draft = tables[0].tolist()
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(k):  # 1. M1 drafts k tokens
        new = defaultdict(float)
        for seq, w in dist.items():
            last = seq[-1] if seq else CTX
            for x in range(V):
                if draft[last][x] > 0:
                    new[seq + (x,)] += w * draft[last][x]
        dist = new
    for below, here in zip(tables[:-1], tables[1:]):  # 2. levels 2..N verify
        # every proposal at any position is a row of `below` (bigram), so tabulate once
        rows = below[:, None, :].expand(V, V, V)  # [c, x, :] = below[c]
        acc = acceptance_probability(rows, here[:, None, :].expand(V, V, V), torch.arange(V).expand(V, V)).tolist()
        res = (here if broken else residual_distribution(below, here)).tolist()  # (V, V)
        p = here.tolist()
        new = defaultdict(float)
        for seq, w in dist.items():
            for a in range(len(seq) + 1):  # a = candidates accepted
                last = seq[a - 1] if a else CTX
                if a == len(seq):  # all accepted: bonus token
                    for y in range(V):
                        new[seq + (y,)] += w * p[last][y]
                    break
                reject = w * (1.0 - acc[last][seq[a]])
                for y in range(V):  # rejected at a: recovered token
                    new[seq[:a] + (y,)] += reject * res[last][y]
                w *= acc[last][seq[a]]
        dist = new
    return dist


def complete(dist: dict[tuple[int, ...], float], target: torch.Tensor, m: int) -> torch.Tensor:
    """Joint (V,)*m of the first m tokens of the output, tokens past the output drawn from the
    target."""
    t = target.tolist()
    out = torch.zeros((V,) * m, dtype=torch.float64)
    for seq, w in dist.items():
        head = seq[:m]
        for tail in itertools.product(range(V), repeat=m - len(head)):
            pw, last = w, head[-1]
            for y in tail:
                pw, last = pw * t[last][y], y
            out[head + tail] += pw
    return out


def target_joint(target: torch.Tensor, m: int) -> torch.Tensor:
    """The target's own joint (V,)*m of its first m tokens after CTX."""
    joint = target[CTX]  # (V,)
    for _ in range(m - 1):  # multiply in target[last, next] along the last two axes
        joint = joint[..., None] * target.view((1,) * (joint.dim() - 1) + (V, V))
    return joint


# ----------------------------------------------------------------------------- Monte Carlo


def run_cycle(tables: list[torch.Tensor], k: int, generator: torch.Generator,
              modes: torch.Tensor | None = None) -> verification.LevelResult:
    """One multi-level cycle for R rows at once; returns the target's LevelResult. A level's
    processed distribution after token c is row c of its processed table (process_logits is
    row-wise, so a lookup equals processing the gathered logits, and is much faster). With
    `modes` (R,), tables are (M, V, V) and row r uses table[modes[r]] (mixed parameters)."""
    if modes is None:
        tables, modes = [t[None] for t in tables], torch.zeros(R, dtype=torch.long)
    # 1. M1 drafts k tokens by sampling its processed distribution
    last = torch.full((R,), CTX, dtype=torch.long)
    drafted, draft_probs = [], []
    for _ in range(k):
        probs = tables[0][modes, last]  # (R, V)
        last = sample(probs, generator)  # (R,)
        drafted.append(last)
        draft_probs.append(probs)
    candidates = torch.stack(drafted, 1)  # (R, k)
    num_candidates = torch.full((R,), k, dtype=torch.long)
    proposal = torch.stack(draft_probs, 1)  # (R, k, V)
    # 2. each level scores all candidates in one "forward" and verifies them
    for table in tables[1:]:
        context = torch.cat([torch.full((R, 1), CTX), candidates.clamp(min=0)], 1)  # (R, n+1); pads -> 0
        verifier_probs = table[modes[:, None], context]  # (R, n+1, V)
        result = verify_speculative(candidates, num_candidates, proposal, verifier_probs, generator)
        candidates, num_candidates, proposal = result.tokens, result.lengths, result.probs
    return result


def empirical_two_tokens(result: verification.LevelResult, target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(V, V) empirical joint of the first two committed tokens, completed from the target."""
    first = result.tokens[:, 0]
    drawn = sample(target[first], generator)  # used where only one token was committed
    second = torch.where(result.lengths >= 2, result.tokens[:, 1], drawn)
    return torch.bincount(first * V + second, minlength=V * V).view(V, V).double() / first.numel()


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


# ----------------------------------------------------------------------------- the tests


def test_tables_are_nontrivial():
    """The levels disagree (else verification would accept everything and prove nothing)."""
    tables = chain_tables(4)
    for below, here in zip(tables[:-1], tables[1:]):
        assert 0.3 < 0.5 * (below - here).abs().sum(-1).mean().item() < 0.9
    assert ((tables[0] == 0).any() and (tables[0] > 0).sum(-1) >= 2).all()  # top_p really filters


@pytest.mark.parametrize(
    "num_levels,k,one_hot_drafter",
    [(2, 1, False), (2, 2, False), (3, 1, False), (3, 2, False), (4, 2, False), (2, 2, True), (3, 2, True)],
)
def test_exact_enumeration_is_lossless(num_levels, k, one_hot_drafter):
    tables = chain_tables(num_levels, one_hot_drafter)
    target = tables[-1]
    dist = exact_cycle(tables, k)
    assert abs(sum(dist.values()) - 1.0) < 1e-12
    assert max(len(s) for s in dist) == k + num_levels - 1  # every level added its bonus token
    for m in sorted({1, 2, k + num_levels - 1}):  # first token, first two, the longest commit
        diff = (complete(dist, target, m) - target_joint(target, m)).abs().max().item()
        assert diff < 1e-12, f"m={m}: off by {diff}"


@pytest.mark.parametrize("num_levels", [2, 3])
def test_exact_enumeration_catches_a_broken_sampler(num_levels):
    """Recovered tokens drawn from verifier_probs instead of the residual: far off target."""
    tables = chain_tables(num_levels)
    broken = exact_cycle(tables, 2, broken=True)
    assert tv(complete(broken, tables[-1], 1), target_joint(tables[-1], 1)) > 0.1


def monte_carlo_tv(tables: list[torch.Tensor], k: int, seed: int = 0) -> tuple[float, float]:
    """TV distances (first token, first two tokens) between one seeded batched cycle and the
    target's exact distribution."""
    generator = torch.Generator().manual_seed(seed)
    target = tables[-1]
    result = run_cycle(tables, k, generator)
    assert (result.lengths >= 1).all() and (result.lengths <= k + len(tables) - 1).all()
    two = empirical_two_tokens(result, target, generator)  # (V, V)
    return tv(two.sum(1), target_joint(target, 1)), tv(two, target_joint(target, 2))


@pytest.mark.parametrize("num_levels,k", [(2, 2), (2, 4), (3, 2), (3, 4)])
def test_monte_carlo_is_lossless(num_levels, k):
    tv1, tv2 = monte_carlo_tv(chain_tables(num_levels), k)
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)


@pytest.mark.parametrize("num_levels", [2, 3])
def test_monte_carlo_with_one_hot_drafter_is_lossless(num_levels):
    """A model-free drafter (n-gram style guesses, one-hot draft_probs) is a valid proposal."""
    tv1, tv2 = monte_carlo_tv(chain_tables(num_levels, one_hot_drafter=True), 4)
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)


@pytest.mark.parametrize("num_levels", [2, 3])
def test_monte_carlo_catches_a_broken_sampler(num_levels, monkeypatch):
    """The same check, same seed, with the recovered token drawn from verifier_probs instead of
    the residual, must fail: the Monte Carlo test has teeth."""
    monkeypatch.setattr(verification, "residual_distribution", lambda draft_probs, verifier_probs: verifier_probs)
    tv1, tv2 = monte_carlo_tv(chain_tables(num_levels), 2)
    assert tv1 > 0.02 and tv2 > 0.02, (tv1, tv2)


# ----------------------------------------------------------------------------- top-k, greedy rows


@pytest.mark.parametrize("params", [TOP_K, GREEDY], ids=["top_k", "greedy"])
@pytest.mark.parametrize("num_levels,k", [(2, 2), (3, 2), (3, 3)])
def test_exact_enumeration_is_lossless_with_top_k_and_greedy(params, num_levels, k):
    tables = chain_tables(num_levels, params=params)
    target = tables[-1]
    dist = exact_cycle(tables, k)
    assert abs(sum(dist.values()) - 1.0) < 1e-12
    for m in (1, 2, k + num_levels - 1):
        diff = (complete(dist, target, m) - target_joint(target, m)).abs().max().item()
        assert diff < 1e-12, f"m={m}: off by {diff}"
    if params is GREEDY:  # one output, the target's greedy sequence
        [(seq, w)] = [(s, w) for s, w in dist.items() if w > 0]
        assert w == pytest.approx(1.0) and target_joint(target, len(seq))[seq] == 1.0


def test_top_k_tables_are_filtered():
    for table in chain_tables(3, params=TOP_K):
        assert ((table > 0).sum(-1) == 3).all()  # no ties in random tables: exactly k survive


def test_exact_enumeration_with_top_k_catches_a_broken_sampler():
    tables = chain_tables(3, params=TOP_K)
    broken = exact_cycle(tables, 2, broken=True)
    assert tv(complete(broken, tables[-1], 1), target_joint(tables[-1], 1)) > 0.05


MIXED = (GREEDY, TOP_K, PARAMS)  # row r runs MIXED[r % 3]


def mixed_monte_carlo(num_levels: int, k: int, seed: int = 0):
    """One seeded batched cycle of rows with mixed parameters: (greedy rows' committed token
    sequences as a set, {mode: (tv first token, tv first two)} for the sampling modes)."""
    generator = torch.Generator().manual_seed(seed)
    tables = mixed_tables(num_levels, MIXED)
    modes = torch.arange(R) % len(MIXED)
    result = run_cycle(tables, k, generator, modes)
    greedy_rows = {tuple(t[:n]) for t, n, m in zip(result.tokens.tolist(), result.lengths.tolist(),
                                                    modes.tolist()) if m == 0}
    tvs = {}
    for m in (1, 2):
        rows = modes == m
        sub = verification.LevelResult(tokens=result.tokens[rows], lengths=result.lengths[rows],
                                       num_accepted=result.num_accepted[rows], probs=None)
        target = tables[-1][m]
        two = empirical_two_tokens(sub, target, generator)
        tvs[MIXED[m]] = (tv(two.sum(1), target_joint(target, 1)), tv(two, target_joint(target, 2)))
    return greedy_rows, tables, tvs


@pytest.mark.parametrize("num_levels,k", [(2, 3), (3, 2)])
def test_monte_carlo_mixed_greedy_and_sampling_rows(num_levels, k):
    """Greedy, top-k and top-p rows in one batch: the tables come from one mixed
    process_logits call; greedy rows all commit the target's greedy sequence (every level
    agreeing or not), sampling rows follow their own processed target."""
    greedy_rows, tables, tvs = mixed_monte_carlo(num_levels, k)
    target = tables[-1][0]
    (seq,) = greedy_rows
    assert target_joint(target, len(seq))[seq] == 1.0  # the target's argmax chain
    for params, (tv1, tv2) in tvs.items():
        # R / 3 rows per mode: noise alone gives TV ~ 0.005-0.01
        assert tv1 < 0.015 and tv2 < 0.02, (params, tv1, tv2)


def test_monte_carlo_mixed_rows_catch_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(verification, "residual_distribution", lambda draft_probs, verifier_probs: verifier_probs)
    _, _, tvs = mixed_monte_carlo(3, 2)
    for params, (tv1, tv2) in tvs.items():
        assert tv1 > 0.03 and tv2 > 0.03, (params, tv1, tv2)
