"""process_logits / sample / greedy, the production verifier (`verify_tokens`) and the reference
sampler (tests/reference_verification.py) on hand-made cases."""

from __future__ import annotations

import pytest
import torch
from reference_verification import (
    acceptance_probability,
    residual_distribution,
    verify_greedy,
    verify_speculative,
)

from specrouter.config import SamplingParams as SP
from specrouter.decoding.sampling import SamplingTensors, greedy, process_logits, sample
from specrouter.decoding.verification import PAD_TOKEN_ID, verify_rows, verify_tokens


def st_of(*params: SP) -> SamplingTensors:
    return SamplingTensors.from_params(list(params))


def logits_of(*probs: float) -> torch.Tensor:
    """(1, V) float64 logits whose softmax is `probs`."""
    return torch.tensor([probs], dtype=torch.float64).log()


def kept(probs: torch.Tensor) -> list[int]:
    return (probs > 0).nonzero().flatten().tolist()


# ----------------------------------------------------------------------------- SamplingTensors


def test_sampling_tensors_from_params_and_select():
    st = st_of(SP(), SP(temperature=0.7, top_p=0.9), SP(temperature=1.0), SP(temperature=0.5, top_k=3))
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.long and st.top_p.dtype == torch.float32
    assert st.top_k.tolist() == [0, 0, 0, 3] and not st.all_greedy and st.any_greedy and st.needs_sort
    sub = st.select(torch.tensor([2, 0]))
    assert sub.temperature.tolist() == [1.0, 0.0] and not sub.all_greedy and sub.any_greedy and not sub.needs_sort
    only_greedy = st.select(torch.tensor([0]))
    assert only_greedy.all_greedy and only_greedy.any_greedy and not only_greedy.needs_sort
    masked = st.select(torch.tensor([False, True, False, True]))
    assert masked.top_k.tolist() == [0, 3] and not masked.any_greedy and masked.needs_sort
    assert st_of(SP(top_k=5, top_p=0.5)).needs_sort is False  # greedy rows never need the sort


# ----------------------------------------------------------------------------- process_logits


def test_temperature_zero_is_one_hot_at_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 0.0, 5.0, 5.0]])
    for st in (st_of(SP(), SP()), st_of(SP(), SP(temperature=0.0, top_k=1))):  # all-greedy path
        probs = process_logits(logits, st)
        assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    mixed = process_logits(logits, st_of(SP(), SP(temperature=1.0, top_p=0.5)))  # mixed path
    assert mixed[0].tolist() == [0, 1, 0, 0] and mixed[1].sum().item() == pytest.approx(1.0)


def test_temperature_scaling_without_filters_is_plain_softmax():
    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(0))
    st = st_of(SP(temperature=0.5), SP(temperature=2.0))
    assert not st.needs_sort
    expected = torch.stack([(logits[0] / 0.5).softmax(-1), (logits[1] / 2.0).softmax(-1)])
    torch.testing.assert_close(process_logits(logits, st), expected)


def test_top_k_keeps_k_ties_at_the_kth_all_kept():
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0]])
    probs = process_logits(logits, st_of(SP(temperature=1.0, top_k=2)))
    assert kept(probs[0]) == [1, 3]
    torch.testing.assert_close(probs[0, [1, 3]], torch.tensor([4.0, 3.0]).softmax(-1))
    ties = process_logits(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), st_of(SP(temperature=1.0, top_k=2)))
    assert kept(ties[0]) == [0, 1, 2]  # the k-th value ties: both survive
    off = process_logits(logits, st_of(SP(temperature=1.0, top_k=99)))  # top_k >= V: no filter
    torch.testing.assert_close(off, logits.softmax(-1))


@pytest.mark.parametrize(
    "top_p,expected", [(0.1, [0]), (0.5, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_nucleus(top_p, expected):
    probs = process_logits(logits_of(0.5, 0.3, 0.15, 0.05), st_of(SP(temperature=1.0, top_p=top_p)))
    assert kept(probs[0]) == expected  # the top token always survives
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)[expected]
    torch.testing.assert_close(probs[0, expected], base / base.sum())  # renormalized


def test_top_p_ties_at_the_boundary_are_all_kept():
    """Documented choice: the nucleus is closed under ties, independent of sort order."""
    probs = process_logits(logits_of(0.4, 0.2, 0.2, 0.2), st_of(SP(temperature=1.0, top_p=0.5)))
    assert kept(probs[0]) == [0, 1, 2, 3]  # strict smallest set would be 2 tokens
    probs = process_logits(logits_of(0.2, 0.4, 0.2, 0.2), st_of(SP(temperature=1.0, top_p=0.3)))
    assert kept(probs[0]) == [1]


def test_top_k_then_top_p_on_the_renormalized_survivors():
    # top_k=3 leaves (0.4, 0.3, 0.2)/0.9 = (.444, .333, .222); top_p=0.7 then needs 2 tokens
    # (on the unfiltered distribution 0.4 + 0.3 = 0.7 would also be 2: use 0.75 to separate)
    probs = process_logits(logits_of(0.4, 0.3, 0.2, 0.1), st_of(SP(temperature=1.0, top_k=3, top_p=0.75)))
    assert kept(probs[0]) == [0, 1]  # .444 + .333 = .778 >= .75
    probs = process_logits(logits_of(0.4, 0.3, 0.2, 0.1), st_of(SP(temperature=1.0, top_k=3, top_p=0.8)))
    assert kept(probs[0]) == [0, 1, 2]


def test_per_row_parameters_and_middle_dims():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 2, 11, generator=g)  # (B, T1, T2, V)
    params = [SP(), SP(temperature=0.7, top_p=0.9), SP(temperature=1.3, top_k=4), SP(temperature=0.9, top_k=5, top_p=0.6)]
    probs = process_logits(logits, st_of(*params))
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3, 2))
    for b, p in enumerate(params):  # each row as if it were alone, each position as if alone
        for t in range(3):
            alone = process_logits(logits[b : b + 1, t, 0], st_of(p))[0]
            torch.testing.assert_close(probs[b, t, 0], alone)
    assert ((probs[2] > 0).sum(-1) == 4).all()  # top-k 4 on distinct random logits
    assert ((probs[0] == 1).sum(-1) == 1).all()  # greedy row: one-hot everywhere
    assert len({tuple(kept(probs[b, 0, 0])) for b in range(4)}) > 1  # rows really differ


def test_dtypes():
    logits = torch.randn(2, 5)
    st = st_of(SP(temperature=0.8, top_p=0.9), SP(temperature=1.0))
    assert process_logits(logits.double(), st).dtype == torch.float64
    assert process_logits(logits.bfloat16(), st).dtype == torch.float32
    assert process_logits(logits.double(), st_of(SP(), SP())).dtype == torch.float64


# ----------------------------------------------------------------------------- sample / greedy


def test_sample_is_reproducible_and_follows_probs():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(50_000, 4)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.dtype == torch.long and a.shape == (50_000,) and torch.equal(a, b)
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    assert freq[1] == 0 and (freq - probs[0]).abs().max() < 0.01
    one_hot = torch.nn.functional.one_hot(torch.tensor([[3, 0], [1, 2]]), 5).float()  # (2, 2, 5)
    assert sample(one_hot, torch.Generator().manual_seed(0)).tolist() == [[3, 0], [1, 2]]


def test_greedy_is_argmax():
    logits = torch.tensor([[[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]]])
    assert greedy(logits).tolist() == [[1, 0]]


# ----------------------------------------------------------------------------- verify_tokens (production)


def logits_for(argmaxes: list[list[int]], V: int = 8) -> torch.Tensor:
    """(B, n+1, V) logits whose argmax at each position is given."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(argmaxes), len(argmaxes[0]), V, generator=g)
    logits.scatter_(-1, torch.tensor(argmaxes)[..., None], 10.0)
    return logits


def test_verify_tokens_all_accepted_mismatch_and_ragged():
    candidates = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 5, 3], [4, 4, 4], [7, 7, 7]])
    num_candidates = torch.tensor([3, 3, 3, 1, 0])
    verifier = logits_for([[1, 2, 3, 6], [0, 2, 3, 6], [1, 2, 3, 6], [4, 5, 5, 5], [2, 1, 1, 1]])
    out = verify_tokens(candidates, num_candidates, verifier.argmax(-1))
    P = PAD_TOKEN_ID
    assert out.tokens.tolist() == [
        [1, 2, 3, 6],  # all accepted -> bonus 6
        [0, P, P, P],  # mismatch at 0 -> recovered 0
        [1, 2, P, P],  # mismatch at 1 -> recovered 2
        [4, 5, P, P],  # 1 valid candidate, accepted -> bonus 5 (candidates past it ignored)
        [2, P, P, P],  # no candidates -> the verifier's token at position 0
    ]
    assert out.num_accepted.tolist() == [3, 0, 1, 1, 0] and out.lengths.tolist() == [4, 1, 2, 2, 1]
    assert out.probs is None and out.tokens.dtype == torch.long
    # the host path the executor takes: the same rows, as lists (ragged candidates, no padding)
    rows = [c[:m] for c, m in zip(candidates.tolist(), num_candidates.tolist())]
    expected = [t[:m] for t, m in zip(out.tokens.tolist(), out.lengths.tolist())]
    assert verify_rows(rows, verifier.argmax(-1).tolist()) == expected


def test_verify_rows_equals_verify_tokens_on_random_rows():
    g = torch.Generator().manual_seed(4)
    B, n = 200, 5
    verifier = torch.randint(0, 3, (B, n + 1), generator=g)
    candidates = torch.where(torch.rand(B, n, generator=g) < 0.8, verifier[:, :n], torch.randint(0, 3, (B, n), generator=g))
    num = torch.randint(0, n + 1, (B,), generator=g)
    out = verify_tokens(candidates, num, verifier)
    expected = [t[:m] for t, m in zip(out.tokens.tolist(), out.lengths.tolist())]
    assert verify_rows([c[:m] for c, m in zip(candidates.tolist(), num.tolist())], verifier.tolist()) == expected
    assert len({len(e) for e in expected}) == n + 1  # every acceptance length occurs


# ----------------------------------------------------------------------------- the reference sampler (tests/)


def test_acceptance_probability_and_residual_exact():
    draft = torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    verifier = torch.tensor([[0.25, 0.5, 0.0, 0.25]], dtype=torch.float64)
    acc = acceptance_probability(draft.expand(4, 4), verifier.expand(4, 4), torch.arange(4))
    assert acc.tolist() == [0.5, 1.0, 0.0, 1.0]  # token 3: draft gave 0, verifier > 0 -> accept
    assert residual_distribution(draft, verifier).tolist() == [[0.0, 0.5, 0.0, 0.5]]
    same = residual_distribution(verifier, verifier)  # no residual mass: falls back to verifier
    assert same.tolist() == verifier.tolist()


def random_probs(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float64).softmax(-1)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_verify_speculative_with_one_hot_verifier_equals_greedy(one_hot_draft):
    g = torch.Generator().manual_seed(5)
    B, n, V = 64, 4, 5
    verifier_logits = torch.randn(B, n + 1, V, generator=g, dtype=torch.float64)
    verifier_probs = process_logits(verifier_logits, SamplingTensors.from_params([SP()] * B))  # one-hot
    draft_probs = random_probs((B, n, V), g)
    if one_hot_draft:
        draft_probs = torch.nn.functional.one_hot(draft_probs.argmax(-1), V).double()
    candidates = sample(draft_probs, g)  # (B, n)
    # make some candidates right, so that every acceptance length occurs
    right = torch.rand(B, n, generator=g) < 0.7
    candidates = torch.where(right, verifier_logits[:, :n].argmax(-1), candidates)
    if one_hot_draft:
        draft_probs = torch.nn.functional.one_hot(candidates, V).double()
    num_candidates = torch.randint(0, n + 1, (B,), generator=g)
    expected = verify_greedy(candidates, num_candidates, verifier_logits)
    got = verify_speculative(candidates, num_candidates, draft_probs, verifier_probs, g)
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.lengths, expected.lengths)
    assert len(set(expected.num_accepted.tolist())) >= 4
    assert got.probs is verifier_probs


def test_verify_speculative_shapes_padding_and_reproducibility():
    g = torch.Generator().manual_seed(9)
    B, n, V = 32, 3, 6
    draft_probs, verifier_probs = random_probs((B, n, V), g), random_probs((B, n + 1, V), g)
    candidates = sample(draft_probs, g)
    num_candidates = torch.tensor([0, 1, 2, 3] * 8)
    candidates[num_candidates == 0] = PAD_TOKEN_ID  # padding past num_candidates is ignored
    a = verify_speculative(candidates, num_candidates, draft_probs, verifier_probs, torch.Generator().manual_seed(1))
    b = verify_speculative(candidates, num_candidates, draft_probs, verifier_probs, torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens) and a.tokens.shape == (B, n + 1)
    assert (a.num_accepted <= num_candidates).all() and torch.equal(a.lengths, a.num_accepted + 1)
    positions = torch.arange(n + 1)
    assert ((a.tokens >= 0) == (positions < a.lengths[:, None])).all()  # valid prefix, then PAD
    accepted = positions[:n] < a.num_accepted[:, None]
    assert torch.equal(a.tokens[:, :n][accepted], candidates[accepted])
    empty = verify_speculative(
        torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long),
        torch.zeros(B, 0, V, dtype=torch.float64), verifier_probs[:, :1], g,
    )
    assert empty.tokens.shape == (B, 1) and (empty.lengths == 1).all() and (empty.tokens >= 0).all()


def test_mixed_batch_greedy_rows_stay_greedy_through_speculative_path():
    """Greedy and sampled requests in one batch can share verify_speculative: greedy rows get
    one-hot drafts and verifiers from process_logits and reduce exactly to argmax matching."""
    g = torch.Generator().manual_seed(11)
    B, n, V = 40, 3, 7
    st = SamplingTensors.from_params([SP(), SP(temperature=0.8, top_p=0.9)] * (B // 2))
    draft_probs = process_logits(torch.randn(B, n, V, generator=g), st)
    verifier_logits = torch.randn(B, n + 1, V, generator=g)
    candidates = sample(draft_probs, g)
    out = verify_speculative(candidates, torch.full((B,), n), draft_probs, process_logits(verifier_logits, st), g)
    ref = verify_greedy(candidates, torch.full((B,), n), verifier_logits)
    greedy_rows = torch.arange(B) % 2 == 0
    assert torch.equal(out.tokens[greedy_rows], ref.tokens[greedy_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_is_argmax_ties_and_nan_included(dtype):
    """`greedy` (max(dim).indices, faster on the CPU) picks what `argmax` picks: the first
    maximal index on ties, a NaN position as the maximum; every shape the engine feeds."""
    from specrouter.decoding.sampling import greedy

    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 49152), (1, 33, 4099), (3, 5, 257), (7, 64)]:
        x = torch.randint(-3, 4, shape, generator=g).to(dtype)  # many ties at the maximum
        assert torch.equal(greedy(x), x.argmax(-1))
        y = torch.randn(shape, generator=g).to(dtype)
        assert torch.equal(greedy(y), y.argmax(-1))
        y.view(-1, shape[-1])[0, 5] = float("nan")
        assert torch.equal(greedy(y), y.argmax(-1))
