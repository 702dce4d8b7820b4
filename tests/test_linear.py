"""runners/linear.py: the packed linear layers agree with F.linear for every row count and dtype,
and the multi-row float32 path is row-invariant (bitwise), the property exact verification
leans on."""

import pytest
import torch
import torch.nn.functional as F

from specrouter.models.runners.linear import (
    ONEDNN,
    Linear,
    linear,
    linear_add,
    row_mode,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16])
def test_linear_matches_reference(dtype, with_bias, n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(40, 24, generator=g, dtype=dtype)
    b = torch.randn(40, generator=g, dtype=dtype) if with_bias else None
    x = torch.randn(n, 24, generator=g, dtype=dtype)
    r = torch.randn(n, 40, generator=g, dtype=dtype)
    lin = Linear.pack(w, b)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(linear(x, lin, row_mode(n)), F.linear(x, w, b), **tol)
    torch.testing.assert_close(linear_add(r, x, lin, row_mode(n)), r + F.linear(x, w, b), **tol)
    assert lin.row.is_contiguous() and lin.row.shape == (24, 40)
    assert (lin.rows is not None) == (ONEDNN and dtype == torch.float32)


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN packed linear")
def test_multi_row_float32_is_row_invariant():
    g = torch.Generator().manual_seed(0)
    lin = Linear.pack(torch.randn(300, 96, generator=g))
    x = torch.randn(9, 96, generator=g)
    full = linear(x, lin, row_mode(9))
    for n in (2, 3, 4, 5, 8):
        assert torch.equal(linear(x[:n].clone(), lin, row_mode(n)), full[:n])
        assert torch.equal(linear(x[-n:].clone(), lin, row_mode(n)), full[-n:])


def test_bfloat16_keeps_the_checkpoint_layout():
    w = torch.randn(8, 4).bfloat16()
    lin = Linear.pack(w)
    assert lin.rows is None and torch.equal(lin.row.t(), w)
    torch.testing.assert_close(linear(torch.ones(3, 4).bfloat16(), lin, row_mode(3)), F.linear(torch.ones(3, 4).bfloat16(), w))
