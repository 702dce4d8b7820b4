"""sampling.py's candidate path for top-k / top-p (`_top_k_top_p_mask_candidates`: the top K of
each row by `topk`, no sort of the vocabulary) keeps the sort path's set (`_top_k_top_p_mask_sort`,
the definition): random, peaked, flat, tied and bfloat16-stepped logits, each control and their
combinations, with and without min-p. A difference is tolerated only where the sort path's mass
before a token lies within 1e-5 of top_p: the two compute the mass differently, and the sort
path's float32 softmax itself is off the float64 mass by up to ~5e-6 near 0.95 over ~1300
tokens (seen here: its nucleus one token short where float64 and the candidate path agree)."""

from __future__ import annotations

import pytest
import torch

from specrouter.config import SamplingParams as SP
from specrouter.decoding import sampling
from specrouter.decoding.noise import position_keys
from specrouter.decoding.sampling import SamplingTensors, _min_p_mask, choose_tokens, process_logits

V = 49152
TOL = 1e-5


def _logits(kind: str, B: int, M: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, M, V, generator=g)
    if kind == "peaked":
        x = x * 2.0
        x[..., :20] += 12.0 * torch.rand(B, M, 20, generator=g)
    elif kind == "flat":
        x = x * 0.05
    elif kind == "tied":
        x = (x * 2.0).round()  # ~10 distinct values: ties at every cut
        x[..., :5] = 6.0
    elif kind == "bf16":
        x = (x * 3.0).to(torch.bfloat16).float()
        x[..., :50] += 4.0
    else:  # random
        x = x * 3.0
    return x


def _tolerated(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(B, M) rows where some token's sort-path mass before lies within TOL of top_p."""
    B, M, _ = x.shape
    s = x.sort(dim=-1, descending=True).values
    k = top_k.view(B, 1, 1)
    k = torch.where((k <= 0) | (k > V), V, k)
    s = s.masked_fill(s < s.gather(-1, (k - 1).expand(B, M, 1)), float("-inf"))
    probs = s.softmax(-1)
    before = probs.cumsum(-1) - probs
    p = top_p.view(B, 1, 1)
    return ((before - p).abs() <= TOL).any(-1) & (p.view(B, 1) < 1.0)


def _check_same(x, top_k, top_p, got):
    want = sampling._top_k_top_p_mask_sort(x, top_k, top_p)
    diff = (want.isfinite() != got.isfinite()).any(-1)  # (B, M)
    assert not (diff & ~_tolerated(x, top_k, top_p)).any(), "kept sets differ away from a top_p tie"
    assert torch.equal(got[got.isfinite()], x[got.isfinite()])  # survivors unchanged


KS = [0, 1, 40, 50, 64, 65, 300, V - 1, V, V + 5]
PS = [1.0, 0.01, 0.5, 0.9, 0.95, 0.999]


@pytest.mark.parametrize("kind", ["random", "peaked", "flat", "tied", "bf16"])
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_candidate_path_keeps_the_sort_paths_set(kind, min_p):
    taken = 0
    for i in range(len(KS)):
        B, M = 3, 2
        x = _logits(kind, B, M, seed=i)
        if min_p:
            x = _min_p_mask(x, torch.full((B,), min_p))
        top_k = torch.tensor([KS[i], KS[(i + 3) % len(KS)], 0])
        top_p = torch.tensor([PS[i % len(PS)], 1.0, PS[(i + 2) % len(PS)]])
        cand = sampling._top_k_top_p_mask_candidates(x, top_k, top_p)
        if cand is not None:
            taken += 1
            _check_same(x, top_k, top_p, cand)
        _check_same(x, top_k, top_p, sampling._top_k_top_p_mask(x, top_k, top_p))
    if kind in ("peaked", "bf16") or min_p:
        assert taken > 0, "the candidate path was never taken"


def test_each_control_alone_and_combined_on_peaked_rows():
    x = _logits("peaked", 4, 3, seed=7)
    for k in KS:
        for p in PS:
            top_k, top_p = torch.full((4,), k), torch.full((4,), p)
            cand = sampling._top_k_top_p_mask_candidates(x, top_k, top_p)
            if k < 300 and p <= 0.5:  # narrow cuts take the candidate path (wide ones may fall back)
                assert cand is not None
            _check_same(x, top_k, top_p, sampling._top_k_top_p_mask(x, top_k, top_p))


def test_negative_controls_an_off_by_one_cut_fails_the_check():
    x = _logits("peaked", 2, 2, seed=3)
    top_k, top_p = torch.tensor([40, 40]), torch.tensor([1.0, 1.0])
    with pytest.raises(AssertionError):  # the (k+1)-th largest as the threshold
        _check_same(x, top_k, top_p, sampling._top_k_top_p_mask_sort(x, top_k + 1, top_p))
    top_k, top_p = torch.tensor([0, 0]), torch.tensor([0.5, 0.5])
    kept = sampling._top_k_top_p_mask(x, top_k, top_p)
    one_more = x.masked_fill(x < x.masked_fill(kept.isfinite(), float("-inf")).amax(-1, keepdim=True),
                             float("-inf")).maximum(kept)  # the nucleus plus the next token
    assert (one_more.isfinite().sum(-1) == kept.isfinite().sum(-1) + 1).all()
    with pytest.raises(AssertionError):
        _check_same(x, top_k, top_p, one_more)


def test_flat_rows_and_nan_fall_back_to_the_sort_path():
    x = _logits("flat", 1, 1, seed=0)  # a nucleus past V / 4: the row is sorted
    got = sampling._top_k_top_p_mask_candidates(x, torch.tensor([0]), torch.tensor([0.9]))
    assert torch.equal(got, sampling._top_k_top_p_mask_sort(x, torch.tensor([0]), torch.tensor([0.9])))
    y = _logits("peaked", 1, 1, seed=0)
    y[0, 0, 5] = float("nan")
    assert sampling._top_k_top_p_mask_candidates(y, torch.tensor([0]), torch.tensor([0.9])) is None
    assert sampling._top_k_top_p_mask(y, torch.tensor([0]), torch.tensor([0.9]))[0, 0, 5].isnan()


def test_same_tokens_and_probabilities_as_the_sort_path(monkeypatch):
    """choose_tokens (the coupled sampler every level uses) and process_logits agree between the
    two paths on a batch mixing greedy rows, top-k, top-p, min-p, float32 and float64."""
    params = [SP(), SP(temperature=0.7, top_p=0.9), SP(temperature=1.0, top_k=40),
              SP(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05), SP(temperature=1.3, top_p=0.5)]
    st = SamplingTensors.from_params(params)
    B, M = len(params), 5
    for dtype in (torch.float32, torch.float64):
        logits = _logits("peaked", B, M, seed=11).to(dtype)
        keys = position_keys(torch.arange(B)[:, None] * 31 + 7, torch.arange(M)[None, :])
        fast_tokens, fast_probs = choose_tokens(logits, st, keys), process_logits(logits, st)
        monkeypatch.setattr(sampling, "FORCE_SORT", True)
        ref_tokens, ref_probs = choose_tokens(logits, st, keys), process_logits(logits, st)
        monkeypatch.setattr(sampling, "FORCE_SORT", False)
        assert torch.equal(fast_tokens, ref_tokens)
        assert torch.equal(fast_probs > 0, ref_probs > 0)
        torch.testing.assert_close(fast_probs, ref_probs)


def test_non_contiguous_logits():
    base = _logits("peaked", 2, 6, seed=5)
    x = base[:, ::2]  # (2, 3, V), strided middle dimension
    top_k, top_p = torch.tensor([40, 0]), torch.tensor([0.9, 0.9])
    got = sampling._top_k_top_p_mask(x, top_k, top_p)
    _check_same(x.contiguous(), top_k, top_p, got)


@pytest.mark.parametrize("controls", ["top_p", "top_k", "both"])
def test_a_rows_output_does_not_depend_on_the_batch(controls):
    """Row-invariance: a row's output, bit for bit, is the same computed alone (plain decoding:
    1 x 1) and inside batches of 1/3/8 rows x 1/5 positions (verification) beside rows that force
    widening (a wide nucleus needing K = 1024 or 4096, a top-k of 1000) or the sort (flat rows)."""
    g = torch.Generator().manual_seed(1)
    kinds = ["peaked", "bf16", "random", "tied", "flat", "peaked", "random", "bf16"]
    k_of = {"top_p": 0, "top_k": 40, "both": 50}[controls]
    p_of = {"top_p": 0.9, "top_k": 1.0, "both": 0.95}[controls]
    for B in (1, 3, 8):
        for M in (1, 5):
            x = torch.cat([_logits(kinds[b], 1, M, seed=100 + b) for b in range(B)])
            x[:, :, :] += 0.0 * torch.rand(B, M, 1, generator=g)
            top_k = torch.tensor([k_of if b % 3 == 0 else [0, 1000, 7][b % 3] for b in range(B)])
            top_p = torch.tensor([p_of if b % 3 == 0 else [0.999, 1.0, 0.5][b % 3] for b in range(B)])
            got = sampling._top_k_top_p_mask(x, top_k, top_p)
            for b in range(B):
                for m in range(M):
                    alone = sampling._top_k_top_p_mask(x[b:b + 1, m:m + 1], top_k[b:b + 1], top_p[b:b + 1])
                    assert torch.equal(got[b, m], alone[0, 0]), (B, M, b, m)


def test_row_invariance_where_top_p_sits_on_a_rounding_boundary():
    """top_p set to the float mass before a candidate (and the float above it), where one ulp of
    the mass flips the cut: the row alone and beside a row that widens the set (top_k 1000) keep
    the same tokens. (9c9e322 summed the mass' denominator over the batch's candidates: 68 of
    these 240 cases flipped.)"""
    for seed in range(40):
        x = _logits("peaked", 1, 1, seed=seed)
        vals = x[0, 0].topk(64).values
        e = torch.exp(vals - vals[0])
        probs = e / torch.exp(x[0, 0] - vals[0]).sum()
        before = probs.cumsum(0) - probs
        other = _logits("random", 1, 1, seed=999)
        for j in (3, 5, 8):
            for p in (before[j], torch.nextafter(before[j], torch.tensor(1.0))):
                top_p = torch.tensor([float(p)])
                alone = sampling._top_k_top_p_mask(x, torch.tensor([0]), top_p)
                both = sampling._top_k_top_p_mask(torch.cat([x, other]), torch.tensor([0, 1000]),
                                                  torch.cat([top_p, torch.tensor([0.999])]))
                assert torch.equal(both[0, 0], alone[0, 0]), (seed, j)
