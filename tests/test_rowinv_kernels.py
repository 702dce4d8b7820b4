"""kernels/rowinv.cpp's ops (the linears, linear256.cpp and linear512.cpp: tests/test_linear.py) against torch references:
RMSNorm, silu * up, and RoPE + cache write + attention over a ragged batch with padding, in
float32 and bfloat16; and each op's result for a row independent of the other rows."""

import pytest
import torch
import torch.nn.functional as F

from specrouter.models.runners.kernels import rowinv, why_not_native
from specrouter.models.runners.rope import apply_rope, rope_tables

ops = rowinv()
# skipped only where the native kernels are not claimed; claimed but not built fails
pytestmark = pytest.mark.skipif(why_not_native() is not None, reason=str(why_not_native()))


@pytest.fixture(autouse=True)
def _built():
    assert ops is not None, "the CPU has the native kernels' flags but they did not build"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@DTYPES
def test_rms_norm_matches_transformers_formula_and_is_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(576, generator=g) * 0.1).to(dtype)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w  # transformers
    y = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y.double(), ref.double(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(7)]), y)


@DTYPES
def test_silu_mul_matches_reference_and_saturates_cleanly(dtype):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(5, 2 * 1536, generator=g) * 4).to(dtype)
    gu[0, :4] = torch.tensor([100.0, -100.0, 1e4, -1e4]).to(dtype)  # exp's clamps, no inf / nan
    y = ops.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, rtol=TOL[dtype] * 5, atol=TOL[dtype] * 5)
    assert torch.equal(torch.cat([ops.silu_mul(gu[i : i + 1]) for i in range(5)]), y)


@DTYPES
def test_the_vector_code_rounds_each_element_as_the_scalar_tail_does(dtype):
    """rms_norm and silu_mul run 8 elements at a time and the last width % 8 one by one: the
    same ops, so the same bits. Widths 12 and 13, rolled so an element moves between the tail
    and the vector part (RMSNorm's inputs are small halves, so its sum of squares is exact in
    any order and the roll changes no scale); NaN included, to the bit."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randint(-8, 9, (3, 12), generator=g) * 0.5).to(dtype)
    w = (1 + torch.randn(12, generator=g) * 0.3).to(dtype)
    for s in (4, 8):
        rolled = ops.rms_norm(x.roll(s, 1), w.roll(s), 1e-5)
        assert torch.equal(rolled, ops.rms_norm(x, w, 1e-5).roll(s, 1)), s
    gate = (torch.randn(3, 13, generator=g) * 4).to(dtype)
    up = (torch.randn(3, 13, generator=g) * 4).to(dtype)
    gate[0, 8], up[1, 9] = float("nan"), float("nan")
    for s in (5, 8):
        rolled = ops.silu_mul(torch.cat([gate.roll(s, 1), up.roll(s, 1)], 1))
        y = ops.silu_mul(torch.cat([gate, up], 1)).roll(s, 1)
        assert torch.equal(rolled.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), s  # NaN bits too


def _reference_attention(qkv, nh, cos, sin, caches, slots, starts, nums):
    """Per valid token: RoPE, write into the float64 caches; per valid query: SDPA over its
    slot's keys [0, pos]. Padding queries: zeros."""
    kc, vc = caches
    B, T, heads, D = qkv.shape
    nkv = (heads - nh) // 2
    x = qkv.double()
    out = torch.zeros(B, T, nh, D, dtype=torch.float64)
    for b in range(B):
        n, s0, slot = nums[b], starts[b], slots[b]
        pos = torch.arange(s0, s0 + n)
        qk = apply_rope(x[b, :n, : nh + nkv], cos[pos, None].double(), sin[pos, None].double())
        kc[slot, :, s0 : s0 + n] = qk[:, nh:].transpose(0, 1)
        vc[slot, :, s0 : s0 + n] = x[b, :n, nh + nkv :].transpose(0, 1)
        keys = kc[slot, :, : s0 + n].repeat_interleave(nh // nkv, 0)  # (nh, L, D)
        values = vc[slot, :, : s0 + n].repeat_interleave(nh // nkv, 0)
        mask = torch.arange(s0 + n) <= pos[:, None]  # (n, L)
        o = F.scaled_dot_product_attention(qk[:, :nh].transpose(0, 1), keys, values, attn_mask=mask, scale=1.0)
        out[b, :n] = o.transpose(0, 1)
    return out


@DTYPES
def test_rope_attention_ragged_batch_matches_sdpa_and_each_row_alone(dtype):
    """Rows of 1, 4 and 3 (+1 padding) tokens at different starts on slots 2, 0, 3 (GQA 9/3,
    head 64): cache writes and outputs match a float64 reference; a row run alone gives the
    same bits; padding tokens write nothing and output zeros."""
    g = torch.Generator().manual_seed(2)
    nh, nkv, D, S, P = 9, 3, 64, 4, 192
    cos, sin = rope_tables(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 1.0, P, torch.float32)
    prefix = torch.randn(S, nkv, P, D, generator=g)  # earlier positions, as if prefilled
    kc, vc = prefix.clone().to(dtype), (prefix * 0.5).to(dtype)
    slots, starts, nums = [2, 0, 3], [70, 5, 130], [1, 4, 3]
    T = 4
    qkv = (torch.randn(3, T, nh + 2 * nkv, D, generator=g) * 0.3).to(dtype)
    sentinel = kc[3, :, 133].clone()  # where row 2's padding token would land

    def run(rows, k, v):
        sel = torch.tensor(rows)
        t = lambda a: torch.tensor(a)[sel]
        return ops.rope_attention(qkv[sel], nh, cos, sin, k, v, t(slots), t(starts), t(nums))

    out = run([0, 1, 2], kc, vc)
    assert torch.equal(kc[3, :, 133], sentinel) and torch.equal(out[2, 3], torch.zeros(nh, D, dtype=dtype))
    ref_caches = (kc.double().clone(), vc.double().clone())
    ref = _reference_attention(qkv, nh, cos, sin, ref_caches, slots, starts, nums)
    tol = TOL[dtype] * 5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(kc.double(), ref_caches[0], rtol=tol, atol=tol)
    for r in range(3):  # alone, on fresh copies of the caches: the same bits
        k2, v2 = prefix.clone().to(dtype), (prefix * 0.5).to(dtype)
        assert torch.equal(run([r], k2, v2)[0], out[r])


def test_rope_attention_rejects_rows_past_the_cache():
    kc = torch.zeros(1, 1, 8, 8)
    qkv = torch.zeros(1, 2, 3, 8)
    cos = sin = torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        ops.rope_attention(qkv, 1, cos, sin, kc, kc.clone(), torch.tensor([0]), torch.tensor([7]), torch.tensor([2]))


@DTYPES
def test_rope_attention_bits_do_not_depend_on_the_threads_sharing_it(dtype):
    """Attention's work items (a row, a KV head, a chunk of its tokens) are sized by the thread
    count, and a bfloat16 item with several tokens (or a tree) widens its keys and values once:
    a query's bits must not move with either. 17 tokens of one row, a ragged batch, and a token
    tree, at 1, 2 and 3 threads (chunks of 17, 9 and 6 tokens on one row's 3 KV heads)."""
    g = torch.Generator().manual_seed(3)
    nh, nkv, D, P = 9, 3, 64, 192
    cos, sin = rope_tables(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 1.0, P, torch.float32)
    prefix = torch.randn(3, nkv, P, D, generator=g)
    qkv = (torch.randn(3, 17, nh + 2 * nkv, D, generator=g) * 0.5).to(dtype)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 3, -1, 7] + [8] * 8])  # a branching tree of 17 nodes
    cases = [([0], [100], [17], None), ([0, 1, 2], [5, 60, 101], [17, 9, 2], None), ([0], [40], [17], parents)]
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for c, (slots, starts, nums, par) in enumerate(cases):
                kc, vc = prefix.clone().to(dtype), (prefix * 0.5).to(dtype)
                B = len(slots)
                out = ops.rope_attention(qkv[:B], nh, cos, sin, kc, vc, torch.tensor(slots), torch.tensor(starts),
                                         torch.tensor(nums), par)
                outs[(n, c)] = (out, kc)
    finally:
        torch.set_num_threads(threads)
    for (n, c), (out, kc) in outs.items():
        assert torch.equal(out, outs[(1, c)][0]) and torch.equal(kc, outs[(1, c)][1]), (n, c)
    # and each row of the ragged batch alone, at 2 threads, gives its bits in the batch
    for r in range(3):
        kc, vc = prefix.clone().to(dtype), (prefix * 0.5).to(dtype)
        sl, st, nu, _ = cases[1]
        alone = ops.rope_attention(qkv[r : r + 1], nh, cos, sin, kc, vc, torch.tensor(sl[r : r + 1]),
                                   torch.tensor(st[r : r + 1]), torch.tensor(nu[r : r + 1]))
        assert torch.equal(alone[0], outs[(2, 1)][0][r]), r


# The kernels' loader in a fresh process, torch's builder faked: a Ctrl-C during the build that
# reaches the loader as another error (CPython turned a KeyboardInterrupt into
# TypeError("expected a message argument"): kernels._InterruptNoted), and a plain build failure.
_LOADER = r"""
import signal, sys
import torch.utils.cpp_extension as ce
from specrouter.models.runners import kernels
def fake_load(**kw):
    if sys.argv[1] == "interrupted":
        try:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: the handler in place raises here
        except KeyboardInterrupt:
            pass
    raise TypeError("expected a message argument")
ce.load = fake_load
kernels.kernel_path = lambda: "avx2"
kernels._cpu_supported = lambda: True
try:
    print("returned", kernels.rowinv())
except KeyboardInterrupt as e:
    print("interrupted", type(e.__cause__).__name__)
print("handler restored", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("mode", ["interrupted", "broken"])
def test_a_ctrl_c_during_the_kernels_build_stays_an_interrupt(tmp_path, mode):
    """A Ctrl-C while the kernels build raises KeyboardInterrupt from the loader even when it
    arrived as another error; a build that fails without one falls back to torch's kernels
    (None) as before; the SIGINT handler is the caller's again afterwards."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("SPECROUTER_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", _LOADER, mode], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split("\n")
    assert out[0] == ("interrupted TypeError" if mode == "interrupted" else "returned None"), out
    assert out[1] == "handler restored True", out
