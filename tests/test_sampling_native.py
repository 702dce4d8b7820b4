"""The native top-k / top-p / min-p cut (kernels/cut.h: `top_k_top_p_mask`, and `choose_tokens`
with filters) keeps exactly the torch candidate path's set (`sampling.NATIVE = False`), bit for
bit, not within a tolerance: random, peaked, flat, tied and bfloat16-stepped logits, each control
and their combinations, with and without min-p, top_p set on the float mass before a candidate
(where one ulp moves the cut), rows that the torch path sorts; each row alone as in any batch.
Negative controls: the boundary cases do move the cut by an ulp of top_p (so equality there is
evidence), and the whole-row mass summed in float (the old definition) differs from the fixed
point one the native cut reproduces."""

from __future__ import annotations

import pytest
import torch

from specrouter.config import SamplingParams as SP
from specrouter.decoding import sampling
from specrouter.decoding.noise import position_keys
from specrouter.decoding.sampling import SamplingTensors, _min_p_mask, choose_at, choose_tokens
from test_sampling_candidates import KS, PS, _logits

pytestmark = pytest.mark.skipif(sampling.native_filters() is None,
                                reason="no native cut here (kernels not built, or torch without MKL's exp)")


def _torch_path(fn, *a):
    sampling.NATIVE = False
    try:
        return fn(*a)
    finally:
        sampling.NATIVE = True


def _both(x, top_k, top_p):
    return (sampling._top_k_top_p_mask(x, top_k, top_p),
            _torch_path(sampling._top_k_top_p_mask, x, top_k, top_p))


@pytest.mark.parametrize("kind", ["random", "peaked", "flat", "tied", "bf16"])
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_native_cut_is_the_torch_candidate_paths_bit_for_bit(kind, min_p):
    for i in range(len(KS)):
        B, M = 3, 2
        x = _logits(kind, B, M, seed=i)
        if min_p:
            x = _min_p_mask(x, torch.full((B,), min_p))
        for top_k, top_p in ((torch.tensor([KS[i], KS[(i + 3) % len(KS)], 0]),
                              torch.tensor([PS[i % len(PS)], 1.0, PS[(i + 2) % len(PS)]])),
                             (torch.zeros(3, dtype=torch.long), torch.full((3,), PS[i % len(PS)]))):
            got, want = _both(x, top_k, top_p)
            assert torch.equal(got, want), (kind, min_p, i, top_k.tolist(), top_p.tolist())


def _boundaries(seeds=range(24)):
    """(x, top_k, top_p) with top_p on the torch path's float mass before candidate j (and the
    float above it): top-p alone (the whole row's mass) and under top-k 50 (the survivors')."""
    for seed in seeds:
        x = _logits("peaked", 1, 1, seed=seed)
        vals = x[0, 0].topk(64).values
        e = torch.exp(vals - vals[0])
        for k in (0, 50):
            z = e[:k].cumsum(0)[-1] if k else sampling._row_mass(torch.exp(x[0, 0] - vals[0]))
            probs = e / z
            before = probs.cumsum(0) - probs
            for j in (2, 4, 7):
                for p in (before[j], torch.nextafter(before[j], torch.tensor(1.0))):
                    yield x, torch.tensor([k]), torch.tensor([float(p)])


def test_top_p_on_a_rounding_boundary_cuts_the_same():
    moved = 0
    cases = list(_boundaries())
    for n in range(0, len(cases), 2):
        kept = []
        for x, top_k, top_p in cases[n:n + 2]:
            got, want = _both(x, top_k, top_p)
            assert torch.equal(got, want), (n, top_k, top_p)
            kept.append(int(got.isfinite().sum()))
        moved += kept[0] != kept[1]
    # negative control: an ulp of top_p moves each of these cuts, so agreeing there is evidence
    assert moved == len(cases) // 2, moved


def test_negative_control_a_float_sum_of_the_row_moves_cuts():
    """The old whole-row mass (torch's float32 sum) instead of the fixed point one: on these
    boundary cases some cuts differ from the native (and torch) path's: the test above would see
    a native cut that summed the row another way."""
    differ = 0
    for x, top_k, top_p in _boundaries(range(12)):
        if int(top_k) != 0:
            continue
        vals = x[0, 0].topk(64).values
        e = torch.exp(vals - vals[0])
        probs = e / torch.exp(x[0, 0] - vals[0]).sum()
        kept = int(((probs.cumsum(0) - probs) < top_p).cumprod(0).sum())
        got = int(sampling._top_k_top_p_mask(x, top_k, top_p).isfinite().sum())
        differ += got != kept
    assert differ > 0


def test_each_row_alone_as_in_a_batch():
    kinds = ["peaked", "bf16", "random", "tied", "flat", "peaked", "random", "bf16"]
    for B in (1, 3, 8):
        for M in (1, 5):
            x = torch.cat([_logits(kinds[b], 1, M, seed=200 + b) for b in range(B)])
            top_k = torch.tensor([[0, 40, 1000, 0][b % 4] for b in range(B)])
            top_p = torch.tensor([[0.9, 0.95, 1.0, 0.999][b % 4] for b in range(B)])
            got = sampling._top_k_top_p_mask(x, top_k, top_p)
            assert torch.equal(got, _torch_path(sampling._top_k_top_p_mask, x, top_k, top_p))
            for b in range(B):
                for m in range(M):
                    alone = sampling._top_k_top_p_mask(x[b:b + 1, m:m + 1], top_k[b:b + 1], top_p[b:b + 1])
                    assert torch.equal(got[b, m], alone[0, 0]), (B, M, b, m)


def test_rows_the_torch_path_sorts_and_nan():
    x = _logits("flat", 2, 1, seed=0)  # a nucleus past V / 4: sorted, by both
    top_k, top_p = torch.tensor([0, 20000]), torch.tensor([0.9, 1.0])
    got, want = _both(x, top_k, top_p)
    assert torch.equal(got, want)
    assert torch.equal(got, sampling._top_k_top_p_mask_sort(x, top_k, top_p))
    y = _logits("peaked", 1, 1, seed=0)
    y[0, 0, 5] = float("nan")
    assert sampling._top_k_top_p_mask(y, torch.tensor([0]), torch.tensor([0.9]))[0, 0, 5].isnan()


def test_small_vocabularies_and_infinities():
    g = torch.Generator().manual_seed(5)
    for V in (1, 2, 7, 63, 64, 65, 300, 1025, 5000):
        x = torch.randn(4, 3, V, generator=g) * 3
        if V > 3:
            x[0, 0, 1] = float("-inf")
            x[1, 1, :] = float("-inf")
            x[2, 2, 2] = float("inf")
        for k, p in ((0, 0.9), (1, 1.0), (3, 0.5), (0, 0.3), (V - 1, 0.99), (2, 0.999)):
            top_k, top_p = torch.full((4,), k), torch.full((4,), p)
            got, want = _both(x, top_k, top_p)
            assert torch.equal(got, want), (V, k, p)


def _mixed_params():
    return [SP(), SP(temperature=0.7, top_p=0.9), SP(temperature=1.0, top_k=40),
            SP(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05), SP(temperature=1.3, top_p=0.5),
            SP(temperature=0.8, min_p=0.1), SP(temperature=0.9, min_p=1.0), SP(temperature=0.7, top_p=0.999, min_p=0.999)]


def test_choose_at_samples_what_the_torch_path_samples():
    params = _mixed_params()
    st = SamplingTensors.from_params(params)
    B, M = len(params), 5
    for seed in range(3):
        logits = _logits("peaked", B, M, seed=30 + seed)
        rows, seeds = list(range(B)), [b * 31 + 7 + seed for b in range(B)]
        positions = [10 + m for _ in range(B) for m in range(M)]
        got = choose_at(logits, st, rows, seeds, positions)
        keys = position_keys(torch.tensor(seeds)[:, None], torch.tensor(positions).view(B, M))
        assert torch.equal(got, _torch_path(choose_tokens, logits, st, keys))
        sampling.FORCE_SORT = True
        try:  # and the sort path's tokens (these rows' cuts are not on a rounding boundary)
            assert torch.equal(got, choose_tokens(logits, st, keys))
        finally:
            sampling.FORCE_SORT = False
        for b in range(B):  # row-invariant: each row alone
            alone = choose_at(logits[b:b + 1], st, [b], seeds[b:b + 1], positions[b * M:(b + 1) * M])
            assert torch.equal(alone[0], got[b])


def test_choose_at_falls_back_where_the_torch_path_sorts():
    params = [SP(temperature=0.7, top_p=0.9), SP(temperature=2.0, top_p=0.95)]
    st = SamplingTensors.from_params(params)
    logits = torch.cat([_logits("peaked", 1, 2, seed=1), _logits("flat", 1, 2, seed=2)])
    got = choose_at(logits, st, [0, 1], [3, 4], [5, 6, 5, 6])
    keys = position_keys(torch.tensor([3, 4])[:, None], torch.tensor([[5, 6], [5, 6]]))
    assert torch.equal(got, _torch_path(choose_tokens, logits, st, keys))
    assert (got >= 0).all()


def test_min_p_one_keeps_the_top_token():
    """min_p = 1 keeps exactly the tokens equal to the top one (the torch compare, not a fused
    subtraction that can drop the top token itself: review19 N1)."""
    st = SamplingTensors.from_params([SP(temperature=0.7, min_p=1.0)] * 4)
    x = _logits("random", 4, 3, seed=9)
    x[1, 0, 7] = x[1, 0].max()  # a tie at the top
    toks = choose_at(x, st, [0, 1, 2, 3], [1, 2, 3, 4], list(range(12)))
    assert torch.equal(toks, x.argmax(-1)) or torch.equal(x.gather(-1, toks[..., None]), x.amax(-1, keepdim=True))


def test_nan_raises_in_the_fused_sampler():
    st = SamplingTensors.from_params([SP(temperature=0.7, top_p=0.9)])
    x = _logits("peaked", 1, 1, seed=0)
    x[0, 0, 3] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        choose_at(x, st, [0], [1], [0])
