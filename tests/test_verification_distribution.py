"""Multi-level verification is lossless: proofs on tiny "table models".

A table model is a bigram table `table[last_token] -> logits over V` (V = 6), different at
every level. What is compared with the target alone:
- the first committed token;
- the first m tokens "completed": the committed tokens, where a token past what this cycle
  committed is the target's own next token given the previous ones. Since every committed token
  is, given everything before it, distributed as the target's next-token distribution (the
  length is a stopping time), the completed m tokens must follow the target's own m-token joint.

PRODUCTION (Monte Carlo, 200k rows with their own seeds, TV < 0.01): one cycle as the executor
runs it: M1 drafts k tokens with `choose_tokens` (counter-based noise keyed by (seed, position));
each level j = 2..N picks its own tokens at the candidates' positions with `choose_tokens` (the
same keys) and calls `verify_tokens`, passing its output up; the target's output is committed.
Negative controls: a verifier that accepts every candidate, and one that recovers with the
candidate's token instead of its own, fail the same check.

Power: under the null (an exact sampler) the empirical two-token joint of R rows (36 cells) has
E[TV] ~ 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi R)) <= 0.5 * 6 * sqrt(2 / (pi R)) = 0.0054 at
R = 200k; for these tables 0.0022-0.0032, standard deviation 0.0007 (400 exact multinomial
draws of R rows per table: largest 0.0061), so the 0.01 line is >= 9 sd above the null's mean.
The controls measure TV 0.40-0.78 (first token 0.40 / 0.61 at 2 / 3 levels), 20x their 0.02 line
and more.

Cost: the Monte Carlo logits are float32 (`MC_DTYPE`), as the runners return them for every model
but a float64 one (runners/llama.py, hf.py), so the
cut takes the production CPU path, the native one (kernels/cut.h, bit for bit the torch candidate
path: tests/test_sampling_native.py): about 1 s a case. In float64 the torch candidate path
loops over the 200k x (k+1) rows in Python (30-75 s a case, 8 minutes for the family); those
float64 cases are marked slow (`make test-slow`), the same checks and thresholds. The float32
tables are the float64 ones within 1e-6, on the same support (`test_float32_tables_...`), so
the float64 target is the reference for both.

REFERENCE (tests/reference_verification.py, not on the production path): classic speculative
sampling (`verify_speculative`), proven exactly by enumerating all drafts and accept/reject
outcomes (float64, 1e-12); a sampler that draws the recovered token from verifier_probs instead
of the residual must fail.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

import reference_verification as reference
from reference_verification import acceptance_probability, residual_distribution

from specrouter.config import SamplingParams
from specrouter.decoding import verification
from specrouter.decoding.noise import position_keys
from specrouter.decoding.sampling import SamplingTensors, choose_tokens, process_logits

V = 6  # vocabulary of the table models
CTX = 0  # the last context token before the cycle
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
TOP_K = SamplingParams(temperature=0.9, top_k=3)  # at most 3 of the 6 tokens survive
GREEDY = SamplingParams(temperature=0.0)  # processed distributions are one-hot at the argmax
R = 200_000  # Monte Carlo draws (rows of one batched cycle)
MC_DTYPE = torch.float32  # the Monte Carlo's logits (docstring: cost); float64 cases are slow
FLOAT64 = pytest.param(torch.float64, marks=pytest.mark.slow, id="float64")
DTYPES = [pytest.param(torch.float32, id="float32"), FLOAT64]
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


# ----------------------------------------------------------------------------- Monte Carlo (production)


def row_keys(rows: int, positions: int, seed: int) -> torch.Tensor:
    """(rows, positions) int64 noise keys: row r has its own seed, position i is i."""
    seeds = torch.arange(rows, dtype=torch.long) + seed * rows
    return position_keys(seeds[:, None], torch.arange(positions, dtype=torch.long)[None, :])


def run_cycle(logit_tables: list[torch.Tensor], k: int, st: SamplingTensors, keys: torch.Tensor,
              guess: torch.Tensor | None = None, modes: torch.Tensor | None = None
              ) -> verification.LevelResult:
    """One multi-level cycle of R rows as the executor runs it; returns the target's
    LevelResult. `logit_tables[j]` (V, V) are level j's logits after each token (M1 first);
    `guess` (V,) replaces M1 by a model-free drafter (after c it guesses guess[c]). The logits
    of a level are gathered at the context tokens, its tokens chosen by `choose_tokens` with the
    row's keys at the same positions at every level (the coupling)."""
    R = keys.shape[0]
    last = torch.full((R,), CTX, dtype=torch.long)
    drafted = []
    for i in range(k):  # 1. M1 drafts k tokens (sequentially, one position each)
        if guess is not None:
            last = guess[last]
        else:
            last = choose_tokens(logit_tables[0][last][:, None], st, keys[:, i:i + 1])[:, 0]  # (R,)
        drafted.append(last)
    candidates = torch.stack(drafted, 1)  # (R, k)
    num_candidates = torch.full((R,), k, dtype=torch.long)
    for table in logit_tables[1:]:  # 2. each level: one "forward" over all candidates, then verify
        n = candidates.shape[1]
        context = torch.cat([torch.full((R, 1), CTX), candidates.clamp(min=0)], 1)  # (R, n+1); pads -> 0
        own = choose_tokens(table[context], st, keys[:, : n + 1])  # (R, n+1)
        result = verification.verify_tokens(candidates, num_candidates, own)
        candidates, num_candidates = result.tokens, result.lengths
    return result


def completed_two(result: verification.LevelResult, target_logits: torch.Tensor, st: SamplingTensors,
                  keys: torch.Tensor) -> torch.Tensor:
    """(R, 2) the first two committed tokens, the second the target's own where only one was
    committed (its token at position 1 after the first)."""
    first = result.tokens[:, 0]
    own = choose_tokens(target_logits[first][:, None], st, keys[:, 1:2])[:, 0]
    return torch.stack([first, torch.where(result.lengths >= 2, result.tokens[:, 1], own)], 1)


def joint_of(two: torch.Tensor) -> torch.Tensor:
    return torch.bincount(two[:, 0] * V + two[:, 1], minlength=V * V).view(V, V).double() / two.shape[0]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def monte_carlo_tv(num_levels: int, k: int, params: SamplingParams = PARAMS, one_hot_drafter: bool = False,
                   seed: int = 0, dtype: torch.dtype = MC_DTYPE) -> tuple[float, float]:
    """TV distances (first token, first two tokens) between one batched production cycle of R
    seeded rows (logits in `dtype`) and the target's exact (processed, float64) distribution."""
    logits = [log_table(s).to(dtype) for s in TABLE_SEEDS[:num_levels]]
    st = SamplingTensors.from_params([params] * R)
    keys = row_keys(R, k + num_levels + 1, seed)
    guess = (2 * torch.arange(V) + 1) % V if one_hot_drafter else None
    result = run_cycle(logits, k, st, keys, guess)
    assert (result.lengths >= 1).all() and (result.lengths <= k + num_levels - 1).all()
    target = processed_table(TABLE_SEEDS[num_levels - 1], params)
    two = joint_of(completed_two(result, logits[-1], st, keys))
    return tv(two.sum(1), target_joint(target, 1)), tv(two, target_joint(target, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_levels,k", [(2, 2), (2, 4), (3, 2), (3, 4)])
def test_monte_carlo_is_lossless(num_levels, k, dtype):
    tv1, tv2 = monte_carlo_tv(num_levels, k, dtype=dtype)
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_levels", [2, 3])
def test_monte_carlo_with_one_hot_drafter_is_lossless(num_levels, dtype):
    """A model-free drafter (n-gram style guesses) is a valid proposal."""
    tv1, tv2 = monte_carlo_tv(num_levels, 4, one_hot_drafter=True, dtype=dtype)
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", [TOP_K, GREEDY], ids=["top_k", "greedy"])
def test_monte_carlo_is_lossless_with_top_k_and_greedy(params, dtype):
    tv1, tv2 = monte_carlo_tv(3, 3, params=params, dtype=dtype)
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)


def _accept_all(candidates, num_candidates, verifier_tokens):
    """Broken: every candidate accepted (the verifier's tokens only past them)."""
    n = candidates.shape[1]
    mine = torch.where(torch.arange(n) < num_candidates[:, None], candidates, verifier_tokens[:, :n])
    return REAL_VERIFY(candidates, num_candidates, torch.cat([mine, verifier_tokens[:, n:]], 1))


def _recover_with_candidate(candidates, num_candidates, verifier_tokens):
    """Broken: on a mismatch, the candidate's token is committed instead of the verifier's."""
    out = REAL_VERIFY(candidates, num_candidates, verifier_tokens)
    rows = torch.nonzero(out.num_accepted < num_candidates).flatten()
    out.tokens[rows, out.num_accepted[rows]] = candidates[rows, out.num_accepted[rows]]
    return out


REAL_VERIFY = verification.verify_tokens


@pytest.mark.parametrize("broken", [_accept_all, _recover_with_candidate], ids=["accept_all", "recover_with_candidate"])
@pytest.mark.parametrize("num_levels", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_monte_carlo_catches_a_broken_verifier(num_levels, broken, dtype, monkeypatch):
    """The same check, same seeds, with a broken `verify_tokens`, must fail: the Monte Carlo
    test has teeth."""
    monkeypatch.setattr(verification, "verify_tokens", broken)
    tv1, tv2 = monte_carlo_tv(num_levels, 2, dtype=dtype)
    assert tv1 > 0.02 and tv2 > 0.02, (tv1, tv2)


MIXED = (GREEDY, TOP_K, PARAMS)  # row r runs MIXED[r % 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_levels,k", [(2, 3), (3, 2)])
def test_monte_carlo_mixed_greedy_and_sampling_rows(num_levels, k, dtype):
    """Greedy, top-k and top-p rows in one batch (one `choose_tokens` call per level over the
    mixed rows): greedy rows all commit the target's greedy sequence, sampling rows follow their
    own processed target."""
    logits = [log_table(s).to(dtype) for s in TABLE_SEEDS[:num_levels]]
    modes = torch.arange(R) % len(MIXED)
    st = SamplingTensors.from_params([MIXED[m] for m in modes.tolist()])
    keys = row_keys(R, k + num_levels + 1, 1)
    result = run_cycle(logits, k, st, keys)
    greedy_rows = {tuple(t[:n]) for t, n, m in zip(result.tokens.tolist(), result.lengths.tolist(),
                                                    modes.tolist()) if m == 0}
    (seq,) = greedy_rows
    assert target_joint(processed_table(TABLE_SEEDS[num_levels - 1], GREEDY), len(seq))[seq] == 1.0
    two = completed_two(result, logits[-1], st, keys)
    for m in (1, 2):
        target = processed_table(TABLE_SEEDS[num_levels - 1], MIXED[m])
        joint = joint_of(two[modes == m])
        tv1, tv2 = tv(joint.sum(1), target_joint(target, 1)), tv(joint, target_joint(target, 2))
        # R / 3 rows per mode: noise alone gives TV ~ 0.005-0.01
        assert tv1 < 0.015 and tv2 < 0.02, (MIXED[m], tv1, tv2)


def test_production_verifier_equals_the_reference_on_one_hot_rows():
    """On greedy (one-hot) rows the reference sampler reduces to argmax matching: the production
    `verify_tokens` against the verifier's argmax gives the same output token for token."""
    g = torch.Generator().manual_seed(5)
    B, n, Vb = 64, 4, 5
    verifier_logits = torch.randn(B, n + 1, Vb, generator=g, dtype=torch.float64)
    one_hot = process_logits(verifier_logits, SamplingTensors.from_params([GREEDY] * B))
    candidates = torch.where(torch.rand(B, n, generator=g) < 0.7, verifier_logits[:, :n].argmax(-1),
                             torch.randint(0, Vb, (B, n), generator=g))
    num_candidates = torch.randint(0, n + 1, (B,), generator=g)
    got = verification.verify_tokens(candidates, num_candidates, verifier_logits.argmax(-1))
    ref = reference.verify_speculative(candidates, num_candidates,
                                       torch.nn.functional.one_hot(candidates, Vb).double(), one_hot, g)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.lengths, ref.lengths)
    assert len(set(got.num_accepted.tolist())) >= 4


# ----------------------------------------------------------------------------- exact enumeration (reference)


@pytest.mark.parametrize("params", [PARAMS, TOP_K], ids=["top_p", "top_k"])
def test_float32_tables_are_the_float64_ones_on_the_same_support(params):
    """The Monte Carlo runs float32 logits against the float64 target: processed in float32, every
    table keeps the float64 table's support (no top-p / top-k cut moved by rounding) and its
    probabilities within 1e-6, far under the Monte Carlo's 0.01 line."""
    for seed in TABLE_SEEDS:
        t64 = processed_table(seed, params)
        logits = log_table(seed).float()[None]  # (1, V, V)
        t32 = process_logits(logits, SamplingTensors.from_params([params]))[0].double()
        assert torch.equal(t32 > 0, t64 > 0)
        assert (t32 - t64).abs().max().item() < 1e-6


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
