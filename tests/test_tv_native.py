"""The router's similarity signal natively (kernels/tv.cpp `tv_rows`, reached through
decoding/tv.py `tv_rows` / `level_tv`) against the torch path (`level_tv_torch`): equal within
float rounding for rows of low to high temperature with and without min-p, in mixed batches,
sub-batches of a sampling table (its greedy rows not measured) and rows of 0..n candidates, on
one thread and two (the split vocabulary); closer to a float64 reference than the torch path; NaN
where the torch path is NaN; rows with top-k / top-p (their thresholds found from candidates, not
a sort) equal too; without the kernels, the torch path; a greedy row measured is an error on both
(sampled rows only: decoding/tv.py; greedy rows were compared at temperature 1 until prune23)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from specrouter.config import SamplingParams
from specrouter.decoding import tv as tvmod
from specrouter.decoding.sampling import SamplingTensors
from specrouter.decoding.tv import level_tv, level_tv_torch, tv_rows


@pytest.fixture
def native():
    if tvmod._native_ops() is None:
        pytest.skip("native kernels unavailable here")


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.05), SamplingParams(temperature=1.3, min_p=0.05),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0.1, min_p=0.3), SamplingParams(temperature=0.4, min_p=0.2)]


def logits_pair(B, n, V, seed, scale=3.0):
    """Drafter logits (B, n, V) and a verifier's (B, n + 1, V) correlated with them."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(B, n, V, generator=g) * scale
    v = torch.randn(B, n + 1, V, generator=g) * scale
    v[:, :n] = 0.6 * v[:, :n] + 0.4 * d
    return d, v


def reference64(d, v, num, params):
    """float64 D_TV per row: the processed distributions."""
    out = []
    for b, p in enumerate(params):
        tvs = []
        for i in range(int(num[b])):
            pair = []
            for x in (d[b, i].double(), v[b, i].double()):
                s = x / p.temperature
                if p.min_p > 0:
                    s = s.masked_fill(s < s.max() + math.log(p.min_p), -math.inf)
                pair.append(torch.softmax(s, -1))
            tvs.append(0.5 * float((pair[0] - pair[1]).abs().sum()))
        out.append(sum(tvs) / len(tvs) if tvs else math.nan)
    return out


@pytest.mark.parametrize("V", [5, 16, 1000, 4097, 49152])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_native_equals_the_torch_path(native, threads, V, n):
    B = len(PARAMS)
    d, v = logits_pair(B, n, V, seed=V * 10 + n)
    num = torch.tensor([n, max(n - 1, 0), n, 1, n, 0])
    st = SamplingTensors.from_params(PARAMS)
    got, want = level_tv(d, v, num, st), level_tv_torch(d, v, num, st)
    assert got.dtype == torch.float64 and got.shape == (B,)
    assert torch.isnan(got).tolist() == torch.isnan(want).tolist() == [c == 0 for c in num.tolist()]
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=0)
    ref = torch.tensor(reference64(d, v, num, PARAMS), dtype=torch.float64)
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), atol=2e-7, rtol=0)  # torch's: ~3e-6


def test_sub_batches_of_a_sampling_table(native, threads):
    """`tv_rows` with verifier rows and sampling rows given by index (the executor's entry): the
    same as `level_tv` on the gathered rows and the selected parameters; the table's greedy rows
    (with filters of their own), named by no row, change nothing."""
    V, n = 3000, 2
    d, v = logits_pair(4, n, V, seed=7)
    table = SamplingTensors.from_params(PARAMS[:4] + [SamplingParams(temperature=0.0, top_k=3, min_p=0.5)] + PARAMS[5:])
    vrows, srows = [3, 0, 2], [2, 5, 0]
    drafts = [list(d[0, :2]), list(d[1, :1]), list(d[2, :2])]
    got = tv_rows(drafts, v, vrows, table, srows)
    want = level_tv_torch(torch.stack([d[0], d[1], d[2]]), v[vrows], torch.tensor([2, 1, 2]),
                          table.select(torch.tensor(srows)))
    assert got == pytest.approx(want.tolist(), abs=1e-5)


def test_filtered_and_non_finite_logits(native, threads):
    """-inf logits (filtered tokens) take no mass; a NaN logit, an all -inf position or an
    infinite logit make the row NaN, as in the torch path."""
    V, n = 700, 2
    d, v = logits_pair(4, n, V, seed=3)
    d[0, 0, ::3] = -math.inf
    v[0, 1, 1::2] = -math.inf
    d[1, 1, 17] = math.nan
    v[2, 0] = -math.inf
    d[3, 0, 5] = math.inf
    num = torch.tensor([2, 2, 2, 2])
    st = SamplingTensors.from_params([SamplingParams(temperature=0.8, min_p=0.1)] * 4)
    got, want = level_tv(d, v, num, st), level_tv_torch(d, v, num, st)
    assert torch.isnan(got).tolist() == torch.isnan(want).tolist() == [False, True, True, True]
    assert got[0].item() == pytest.approx(want[0].item(), abs=1e-5)


def test_identical_distributions_are_zero_and_disjoint_are_one(native):
    V = 2048
    x = torch.randn(1, 2, V) * 4
    st = SamplingTensors.from_params([SamplingParams(temperature=0.9)])
    assert level_tv(x, x, torch.tensor([2]), st).item() == pytest.approx(0.0, abs=1e-7)
    a, b = torch.full((1, 1, V), -50.0), torch.full((1, 2, V), -50.0)
    a[0, 0, 0], b[0, 0, 1] = 50.0, 50.0
    assert level_tv(a, b, torch.tensor([1]), st).item() == pytest.approx(1.0, abs=1e-6)


FILTERED = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.1, top_k=20),
            SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02), SamplingParams(temperature=0.5, top_p=0.01),
            SamplingParams(temperature=1.0, top_k=3, min_p=0.9), SamplingParams(temperature=2.0, top_p=0.999)]


@pytest.mark.parametrize("V", [100, 5000, 49152])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_top_k_and_top_p_rows_equal_the_torch_path(native, threads, V, scale):
    """Rows with top-k / top-p (with min-p, a top_p of 0.01: the top token; more min-p survivors
    than k and fewer) beside plain and low-temperature rows, flat to peaked logits, and logits in
    bfloat16's steps (ties, as a bfloat16 model's): the torch path's values."""
    params = FILTERED + [SamplingParams(temperature=0.7), SamplingParams(temperature=0.1, top_k=5)]
    n = 2
    d, v = logits_pair(len(params), n, V, seed=V + int(scale * 10), scale=scale)
    d, v = d.bfloat16().float(), v.bfloat16().float()
    num = torch.tensor([2, 1, 2, 2, 1, 2, 2, 1])
    st = SamplingTensors.from_params(params)
    got, want = level_tv(d, v, num, st), level_tv_torch(d, v, num, st)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_without_the_kernels_the_torch_path_serves(monkeypatch):
    """No native kernels (a CPU without AVX2, SPECROUTER_KERNELS=torch, a failed build): `tv_rows`
    is `level_tv_torch` on the gathered rows, bit for bit."""
    monkeypatch.setattr(tvmod, "_native_ops", lambda: None)
    d, v = logits_pair(len(PARAMS), 2, 999, seed=5)
    num = torch.tensor([2, 1, 2, 0, 2, 1])
    st = SamplingTensors.from_params(PARAMS)
    got, want = level_tv(d, v, num, st), level_tv_torch(d, v, num, st)
    assert got.nan_to_num(-1.0).tolist() == want.nan_to_num(-1.0).tolist()


@pytest.mark.parametrize("kernels", [True, False])
def test_a_greedy_row_measured_is_an_error(kernels, monkeypatch):
    """Sampled rows only: a greedy row named by `srows` raises a ValueError on both paths (the
    native kernel's check and the torch path's), a clear error, not a distance of some other
    distribution; the same table's sampled row alone is measured."""
    if kernels and tvmod._native_ops() is None:
        pytest.skip("native kernels unavailable here")
    if not kernels:
        monkeypatch.setattr(tvmod, "_native_ops", lambda: None)
    d, v = logits_pair(2, 1, 400, seed=9)
    table = SamplingTensors.from_params([SamplingParams(temperature=0.0, top_k=3, min_p=0.5),
                                         SamplingParams(temperature=0.7, top_k=10, min_p=0.1)])
    with pytest.raises(ValueError, match="greedy"):
        tv_rows([[d[0, 0]], [d[1, 0]]], v, [0, 1], table, [0, 1])
    got = tv_rows([[d[1, 0]]], v, [1], table, [1])
    alone = level_tv_torch(d[1:], v[1:], torch.tensor([1]), table.select(torch.tensor([1])))
    assert got == pytest.approx(alone.tolist(), abs=1e-5)


def test_the_avx2_passes_equal_the_torch_path_too(native):
    """SPECROUTER_KERNELS=avx2 (read when the library loads: a fresh process) forces the 8-lane
    passes on a CPU with AVX-512: the same values within float rounding, filters included."""
    code = """
import torch
from specrouter.config import SamplingParams
from specrouter.decoding.sampling import SamplingTensors
from specrouter.decoding.tv import level_tv, level_tv_torch
g = torch.Generator().manual_seed(2)
params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.05), SamplingParams(temperature=1.3, min_p=0.05),
          SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=20)]
for V in (13, 4097, 49152):
    d = (torch.randn(5, 2, V, generator=g) * 3).bfloat16().float()
    v = (torch.randn(5, 3, V, generator=g) * 3).bfloat16().float()
    v[:, :2] = 0.6 * v[:, :2] + 0.4 * d
    num = torch.tensor([2, 1, 2, 2, 1])
    st = SamplingTensors.from_params(params)
    assert (level_tv(d, v, num, st) - level_tv_torch(d, v, num, st)).abs().max() < 1e-5, V
print("ok")
"""
    env = dict(os.environ, SPECROUTER_KERNELS="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_min_p_one_keeps_the_top_token(native):
    """min_p = 1 keeps the top token (and its ties) on both sides: a value, as the torch path's
    (review19 N1: the fused compare s - max < log(min_p) dropped the top token itself where
    x * (1 / T) - max rounded below 0, and the position read NaN)."""
    st = SamplingTensors.from_params([SamplingParams(temperature=0.7, min_p=1.0),
                                      SamplingParams(temperature=0.3, min_p=0.9999999)] * 2)
    d, v = logits_pair(4, 2, 4097, seed=21, scale=3.0)
    num = torch.tensor([2, 2, 1, 2])
    got, want = level_tv(d, v, num, st), level_tv_torch(d, v, num, st)
    assert got.isfinite().all(), got
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_each_side_keeps_the_samplers_set(native):
    """Each side's distribution is over exactly the tokens the sampler may draw: D_TV between a
    row's logits and themselves with the tokens the sampler's top-k / min-p cut removes lowered
    (a cut that does not depend on their mass, unlike top-p's) is 0."""
    from specrouter.decoding.sampling import native_filters, scaled_logits
    if native_filters() is None:
        pytest.skip("no native cut here")
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.1, top_k=20),
              SamplingParams(temperature=0.9, top_k=50, min_p=0.02), SamplingParams(temperature=0.8, min_p=0.2)]
    st = SamplingTensors.from_params(params)
    d, _ = logits_pair(4, 2, 49152, seed=3, scale=3.0)
    kept = scaled_logits(d, st).isfinite()
    v = torch.where(kept, d, d - 5.0)  # the filtered tokens moved: the same processed distribution
    v = torch.cat([v, v[:, :1]], 1)
    assert level_tv(d, v, torch.tensor([2, 2, 2, 2]), st).abs().max() < 1e-6
    w = torch.where(kept, d, d + 5.0).clone()  # negative control: raising them moves some into the cut
    w = torch.cat([w, w[:, :1]], 1)
    assert level_tv(d, w, torch.tensor([2, 2, 2, 2]), st).max() > 1e-3
