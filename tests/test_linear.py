"""runners/linear.py: the packed linear layers agree with F.linear for every row count and dtype,
and every row count (1 included) runs one kernel whose result for a row is bitwise independent
of the other rows, the property exact verification leans on; runners/attention.py likewise."""

import logging
import re

import pytest
import torch
import torch.nn.functional as F

from specrouter.models.runners.attention import (
    KEY_CHUNK,
    attention,
    blocked_keys,
    padded_length,
)
from specrouter.models.runners.kernels import PATHS, kernel_path, rowinv, why_not, why_not_native
from specrouter.models.runners.linear import (
    ATEN_LINEAR,
    FALLBACK_BY_DTYPE,
    MM,
    NATIVE_BY_PATH,
    ONEDNN,
    ONEDNN_BLOCKED,
    ROWINV,
    Linear,
    kernel_for,
    kernels,
    linear,
    linear_add,
)

def _path(path: str):
    """A kernel path as a test id: skipped only where it is not claimed here (the CPU lacks a
    flag, named in the reason, or SPECROUTER_KERNELS=torch); claimed but not built fails
    (`_kernel`)."""
    reason = why_not(path) or why_not_native()
    return pytest.param(path, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


NATIVE_PATHS = [_path(p) for p in PATHS if p != "torch"]
WHICH = [*NATIVE_PATHS, "torch"]


def _kernel(which: str, dtype: torch.dtype) -> str:
    """The kernel a test runs: path `which`'s native one (float32 / bfloat16) or torch's fallback."""
    if which != "torch":
        assert rowinv() is not None, "the CPU has the native kernels' flags but they did not build"
    if which != "torch" and dtype in (torch.float32, torch.bfloat16):
        return NATIVE_BY_PATH[which][dtype]
    return FALLBACK_BY_DTYPE[dtype]


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16])
def test_linear_matches_reference(which, dtype, with_bias, n):
    """Output counts that are not a multiple of 4 (the native kernel pads them), every row
    count that takes another path (1, 2, odd, many)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(42, 32, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(42, generator=g, dtype=torch.float64).to(dtype) if with_bias else None
    x = torch.randn(n, 32, generator=g, dtype=torch.float64).to(dtype)
    r = torch.randn(n, 42, generator=g, dtype=torch.float64).to(dtype)
    lin = Linear.pack(w, b, kernel=_kernel(which, dtype))
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float64: 1e-12}[dtype]
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(linear(x, lin).double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(linear_add(r, x, lin).double(), r.double() + ref, rtol=tol, atol=tol)
    assert lin.kernel == _kernel(which, dtype)


@pytest.mark.parametrize("which", NATIVE_PATHS)
def test_native_kernel_falls_back_where_its_blocks_do_not_divide_the_input(which):
    in_f = 23  # the native bfloat16 kernels read pairs (k, k + 1)
    lin = Linear.pack(torch.randn(8, in_f, dtype=torch.bfloat16), kernel=_kernel(which, torch.bfloat16))
    assert lin.kernel == FALLBACK_BY_DTYPE[torch.bfloat16]
    x = torch.randn(3, in_f, dtype=torch.bfloat16)
    assert torch.equal(linear(x, lin), torch.cat([linear(x[i : i + 1], lin) for i in range(3)]))


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_row_count_is_row_invariant(which, dtype, with_bias):
    """1 row, 2-3 rows, and 4..40 rows (33: a token tree's budget; AMX's 16-row tiles split 17,
    33 and 40 rows into blocks): each row's bits are those of a 1-row call, for the plain and
    the residual-fused kernel (SmolLM2-135M's o_proj / down_proj widths, the draft's hidden 192
    and MLP 512, and an input width of 200: AMX's 32-wide k chunks leave a tail of 8)."""
    if which != "torch" and dtype == torch.float64:
        pytest.skip("float64 has one kernel (mm)")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((576, 576), (576, 1536), (192, 192), (192, 512), (48, 200)):
        lin = Linear.pack((torch.randn(out_f, in_f, generator=g) * 0.05).to(dtype),
                          torch.randn(out_f, generator=g).to(dtype) if with_bias else None,
                          kernel=_kernel(which, dtype))
        x = torch.randn(40, in_f, generator=g).to(dtype)
        r = torch.randn(40, out_f, generator=g).to(dtype)
        one = torch.cat([linear(x[i : i + 1], lin) for i in range(40)])
        one_add = torch.cat([linear_add(r[i : i + 1], x[i : i + 1], lin) for i in range(40)])
        for n in (2, 3, 4, 5, 8, 9, 16, 17, 33, 40):
            for lo in (0, 40 - n):
                assert torch.equal(linear(x[lo : lo + n], lin), one[lo : lo + n]), (n, lo)
                assert torch.equal(linear_add(r[lo : lo + n], x[lo : lo + n], lin), one_add[lo : lo + n])


@pytest.mark.parametrize("which", NATIVE_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_tiles_partial_outputs_get_the_bits_of_whole_ones(which, dtype):
    """A native kernel finishes a tile's outputs 8 or 16 at a time, and the last tile's partial
    group one by one (or masked): the same ops, so an output has the same bits whether it is
    finished in a whole group or in the partial tail (outputs 32-33 of 34 and of 48)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 64, generator=g) * 0.1).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    r = torch.randn(5, 48, generator=g).to(dtype)
    kernel = _kernel(which, dtype)
    whole, part = Linear.pack(w, b, kernel=kernel), Linear.pack(w[:34], b[:34], kernel=kernel)
    assert torch.equal(linear(x, part), linear(x, whole)[:, :34])
    assert torch.equal(linear_add(r[:, :34], x, part), linear_add(r, x, whole)[:, :34])


def _cpu_vendor() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.parametrize("which", [p for p in NATIVE_PATHS if p.values[0] in ("amx", "avx512bf16", "avx512")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear512s_prefetch_policies_give_the_same_bits(which, dtype):
    """linear512's float32 and vdpbf16ps tiles prefetch their weight stream 8 KiB ahead,
    non-temporal, on AMD and 2 KiB ahead into L1 elsewhere, where float32 at 1-3 rows also runs
    4 tiles side by side (`set_linear512_prefetch`, "auto" the CPU vendor's, docs/kernels.md
    session 29): the same FMAs per output, so every row count 1-33 gets the same bits under
    both, plain and residual-fused, on a weight of 7 tiles (a group of 4 and single tiles) whose
    prefetches run past its end; an unknown policy is refused."""
    kernel = _kernel(which, dtype)
    ops = rowinv()
    g = torch.Generator().manual_seed(29)
    lin = Linear.pack((torch.randn(200, 96, generator=g) * 0.1).to(dtype), torch.randn(200, generator=g).to(dtype),
                      kernel=kernel)
    x = torch.randn(33, 96, generator=g).to(dtype)
    r = torch.randn(33, 200, generator=g).to(dtype)
    before = ops.set_linear512_prefetch("auto")
    try:
        assert ops.set_linear512_prefetch("auto") == ("nta" if _cpu_vendor() == "AuthenticAMD" else "t0")
        out = {}
        for kind in ("nta", "t0"):
            ops.set_linear512_prefetch(kind)
            out[kind] = [(linear(x[:n], lin), linear_add(r[:n], x[:n], lin)) for n in range(1, 34)]
        for (a, a_add), (b, b_add) in zip(out["nta"], out["t0"]):
            assert torch.equal(a, b) and torch.equal(a_add, b_add)
        assert torch.equal(out["t0"][32][0][:5], out["t0"][4][0])  # and row-invariant
        with pytest.raises(RuntimeError, match="nta, t0 or auto"):
            ops.set_linear512_prefetch("t1")
    finally:
        ops.set_linear512_prefetch(before)


def test_kernels_name_one_choice_per_precision():
    assert FALLBACK_BY_DTYPE[torch.float32] == (ONEDNN_BLOCKED if ONEDNN else MM)
    assert FALLBACK_BY_DTYPE[torch.bfloat16] in (ONEDNN_BLOCKED, ATEN_LINEAR)
    native = rowinv() is not None and kernel_path() != "torch"
    for dtype in (torch.float32, torch.bfloat16):
        assert kernel_for(dtype) == (NATIVE_BY_PATH[kernel_path()][dtype] if native else FALLBACK_BY_DTYPE[dtype])
    assert kernel_for(torch.float64) == MM
    name = kernels()
    assert name.startswith(kernel_path() + ":")
    assert kernel_for(torch.float32) in name and kernel_for(torch.bfloat16) in name


def test_the_fastest_path_the_cpu_has_is_chosen_and_a_forced_one_must_exist(monkeypatch):
    """No SPECROUTER_KERNELS: the first of PATHS whose flags the CPU has (a Zen 1 without
    AVX-512 gets avx2, a Zen 4 avx512bf16, a Sapphire Rapids amx); a forced path the CPU lacks,
    or an unknown one, is an error naming the flag, never a silent substitute."""
    from specrouter.models.runners import kernels as k

    monkeypatch.delenv("SPECROUTER_KERNELS", raising=False)
    monkeypatch.setattr(k, "amx_permission", lambda: None)
    zen1 = frozenset({"avx2", "fma", "sse4_2"})
    zen4 = zen1 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    spr = zen4 | {"amx_tile", "amx_bf16", "amx_int8"}
    for flags, want in ((zen1, "avx2"), (zen4, "avx512bf16"), (zen4 - {"avx512_bf16"}, "avx512"),
                        (spr, "amx"), (spr - {"amx_bf16"}, "avx512bf16"), (frozenset({"sse4_2"}), "torch")):
        monkeypatch.setattr(k, "cpu_flags", lambda flags=flags: flags)
        k.kernel_path.cache_clear()
        assert k.kernel_path() == want
    monkeypatch.setattr(k, "cpu_flags", lambda: zen1)
    for forced, error, words in (("avx512bf16", RuntimeError, "avx512f"), ("avx512", RuntimeError, "avx512bw"),
                                 ("amx", RuntimeError, "amx_tile, amx_bf16"),
                                 ("sse9", ValueError, "amx, avx512bf16, avx512, avx2, torch")):
        monkeypatch.setenv("SPECROUTER_KERNELS", forced)
        k.kernel_path.cache_clear()
        with pytest.raises(error, match=words):
            k.kernel_path()
    monkeypatch.setenv("SPECROUTER_KERNELS", "avx2")
    k.kernel_path.cache_clear()
    assert k.kernel_path() == "avx2"
    monkeypatch.undo()
    k.kernel_path.cache_clear()


def test_amx_is_unavailable_with_a_reason_where_the_os_refuses_the_tile_state(monkeypatch):
    """A CPU with the AMX flags whose OS does not grant the tile data state (an old kernel, a VM
    without it: arch_prctl refuses, or succeeds and grants nothing) has no amx path: why_not says
    why, the default falls to avx512bf16, a forced amx is that error; never a SIGILL."""
    from specrouter.models.runners import kernels as k

    monkeypatch.delenv("SPECROUTER_KERNELS", raising=False)
    spr = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
                     "amx_bf16"})
    monkeypatch.setattr(k, "cpu_flags", lambda: spr)
    refused = "the OS did not grant the AMX tile state (ARCH_GET_XCOMP_PERM lacks XTILEDATA)"
    monkeypatch.setattr(k, "amx_permission", lambda: refused)
    assert k.why_not("amx") == refused + " (kernel path amx)"
    assert k.why_not("avx512bf16") is None
    k.kernel_path.cache_clear()
    assert k.kernel_path() == "avx512bf16"
    monkeypatch.setenv("SPECROUTER_KERNELS", "amx")
    k.kernel_path.cache_clear()
    with pytest.raises(RuntimeError, match="ARCH_GET_XCOMP_PERM lacks XTILEDATA"):
        k.kernel_path()
    monkeypatch.undo()
    k.kernel_path.cache_clear()


def test_the_amx_permission_is_asked_of_the_os_and_agrees_with_the_native_check():
    """Where the CPU has the AMX flags, the Python check (ctypes arch_prctl) and linearamx.cpp's
    own (before any tile instruction) agree."""
    from specrouter.models.runners import kernels as k

    if k.missing_flags("amx") or why_not_native():
        pytest.skip(why_not("amx") or why_not_native())
    assert rowinv() is not None
    native = rowinv().amx_ready()
    assert (native == "") == (k.amx_permission() is None), (native, k.amx_permission())


def _amx_ops(vector: bool = False):
    """torch.ops.specrouter_rowinv where the amx path runs here, else a skip naming why not;
    vector: also skipped where the vector form's self-check turned it off on this CPU (the tiles
    then run every row count: row invariance holds, there is no second form to compare)."""
    reason = why_not("amx") or why_not_native()
    if reason:
        pytest.skip(reason)
    assert rowinv() is not None, "the CPU has the native kernels' flags but they did not build"
    verdict = rowinv().amx_vector_check()
    if vector and not verdict.startswith("on"):
        pytest.skip(f"the amx vector form is {verdict}")
    return rowinv()


def _bf16_bits(g: torch.Generator, shape: tuple[int, int], kind: str) -> torch.Tensor:
    """bfloat16 values built from their bits: "normal" exponents 2^-3..2^3; "wide" 2^-40..2^20;
    "tiny" a third zeros and denormals, the rest near 2^-63 (products near the smallest normal
    float32: sums flushed to zero); "cancel" two mantissa bits, and each odd k the negation of the
    even k before it on one side and the same on the other (the even and odd sums cancel
    exactly; ties of the rounding)."""
    n = shape[0] * shape[1]
    sign = torch.randint(0, 2, (n,), generator=g) << 15
    man = torch.randint(0, 128, (n,), generator=g)
    lo, hi = {"normal": (124, 131), "wide": (87, 148), "tiny": (62, 66), "cancel": (126, 129)}[kind]
    exp = torch.randint(lo, hi, (n,), generator=g)
    if kind == "tiny":
        exp = torch.where(torch.randint(0, 3, (n,), generator=g) == 0, torch.zeros_like(exp), exp)
    if kind == "cancel":
        man = man % 4
    bits = sign | (exp << 7) | man
    t = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16).view(shape)
    return t


SUMS_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (1024, 192), (192, 512), (48, 200), (40, 30))


@pytest.mark.parametrize("kind", ["normal", "wide", "tiny", "cancel"])
def test_amx_vector_form_computes_the_tiles_float32_sums_bit_for_bit(kind):
    """The amx path's few-row form (AVX-512 FMAs: per 32-k chunk the even and the odd products
    in two sums, then C + (even + odd), flushed as tdpbf16ps flushes) against the AMX tiles, on
    the float32 sums before the finish (a bfloat16 output would hide an ulp): every row count it
    takes (1-4) and the tile form's 1-16 rows, at the 135M widths (qkv, o, gate|up, down), the
    draft's (hidden 192, MLP 512), a K tail (200: 8 past the last chunk; 30: no whole chunk),
    on typical, wide-exponent, denormal / flushed and exactly cancelling data."""
    ops = _amx_ops(vector=True)
    g = torch.Generator().manual_seed(11)
    before = ops.set_amx_vector_rows(4)
    try:
        for out_f, in_f in SUMS_SHAPES:
            w = _bf16_bits(g, (out_f, in_f), kind)
            x = _bf16_bits(g, (16, in_f), kind)
            if kind == "cancel":
                w[:, 1::2] = -w[:, 0::2]
                x[:, 1::2] = x[:, 0::2]
            packed = Linear.pack(w, kernel=_kernel("amx", torch.bfloat16)).weight
            ops.set_amx_vector_rows(0)
            tiles = ops.linear_amx_sums(x, packed, out_f)  # 16 rows: one AMX row block
            assert torch.isfinite(tiles).all()
            for n in range(1, 17):
                for lo in (0, 16 - n):
                    ops.set_amx_vector_rows(0)
                    t = ops.linear_amx_sums(x[lo : lo + n], packed, out_f)
                    assert torch.equal(t.view(torch.int32), tiles[lo : lo + n].view(torch.int32)), (out_f, in_f, n)
                    if n <= 4:
                        ops.set_amx_vector_rows(4)
                        v = ops.linear_amx_sums(x[lo : lo + n], packed, out_f)
                        assert torch.equal(v.view(torch.int32), t.view(torch.int32)), (out_f, in_f, n, lo)
    finally:
        ops.set_amx_vector_rows(before)


def test_amx_vector_form_and_the_tiles_meet_at_every_threshold():
    """However many rows the vector form takes (set_amx_vector_rows 0-4; 2 by default), a row's
    output is that of a 1-row call on the tiles, plain and residual-fused, on each side of the
    threshold (n = threshold and threshold + 1), at the LM head's width (576 -> 49152, where a
    1-token step runs it too) and a K tail; 5 rows is refused."""
    ops = _amx_ops(vector=True)
    g = torch.Generator().manual_seed(12)
    before = ops.set_amx_vector_rows(0)
    try:
        for out_f, in_f in ((49152, 576), (48, 200)):
            lin = Linear.pack((torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16),
                              torch.randn(out_f, generator=g).to(torch.bfloat16), kernel=_kernel("amx", torch.bfloat16))
            x = torch.randn(6, in_f, generator=g).to(torch.bfloat16)
            r = torch.randn(6, out_f, generator=g).to(torch.bfloat16)
            ops.set_amx_vector_rows(0)
            one = torch.cat([linear(x[i : i + 1], lin) for i in range(6)])
            one_add = torch.cat([linear_add(r[i : i + 1], x[i : i + 1], lin) for i in range(6)])
            for rows in range(5):
                ops.set_amx_vector_rows(rows)
                for n in {max(rows, 1), rows + 1}:
                    assert torch.equal(linear(x[:n], lin), one[:n]), (out_f, rows, n)
                    assert torch.equal(linear_add(r[:n], x[:n], lin), one_add[:n]), (out_f, rows, n)
        with pytest.raises(RuntimeError, match="0..4 rows"):
            ops.set_amx_vector_rows(5)
    finally:
        ops.set_amx_vector_rows(before)
    assert ops.set_amx_vector_rows(before) == before


def test_amx_vector_forms_finish_keeps_ieee_denormals_like_the_tiles():
    """The vector form flushes denormals as tdpbf16ps does (MXCSR FTZ | DAZ) in its sums only: its
    finish (+ bias, + residual, rounding) runs under the caller's MXCSR as the tiles' does, so a
    denormal bias or residual, or a sum that rounds to a denormal, gives the tiles' bits."""
    ops = _amx_ops(vector=True)
    g = torch.Generator().manual_seed(14)
    tiny = torch.finfo(torch.float32).tiny
    w = (torch.randn(64, 64, generator=g) * 2**-62).to(torch.bfloat16)
    x = (torch.randn(2, 64, generator=g) * 2**-62).to(torch.bfloat16)  # sums ~2^-121: normal; + denormals
    b = (torch.randn(64, generator=g) * tiny * 0.3).to(torch.bfloat16)  # denormal bfloat16
    r = (torch.randn(2, 64, generator=g) * tiny * 0.3).to(torch.bfloat16)
    assert (b != 0).any() and (b.float().abs() < tiny).all()
    lin = Linear.pack(w, b, kernel=_kernel("amx", torch.bfloat16))
    before = ops.set_amx_vector_rows(0)
    try:
        tiles = [linear(x[:n], lin) for n in (1, 2)] + [linear_add(r[:n], x[:n], lin) for n in (1, 2)]
        ops.set_amx_vector_rows(2)
        vector = [linear(x[:n], lin) for n in (1, 2)] + [linear_add(r[:n], x[:n], lin) for n in (1, 2)]
    finally:
        ops.set_amx_vector_rows(before)
    plain = Linear.pack(w, torch.zeros_like(b), kernel=_kernel("amx", torch.bfloat16))
    assert not torch.equal(tiles[1], linear(x[:2], plain))  # the denormal bias changes outputs (no DAZ there)
    for t, v in zip(tiles, vector):
        assert torch.equal(t.view(torch.int16), v.view(torch.int16))


def test_amx_vector_form_runs_only_where_its_self_check_passes(caplog):
    """Before the first AMX linear a process checks the vector form against the tiles on 4096
    float32 sums (kernels/linearamx.cpp `vector_check`); the verdict is in `kernels()` (so in the
    profile fingerprint and bench.json). Negative control: a vector form that rounds otherwise
    (C + even + odd, left to right) fails the check, which turns it off with a warning naming the
    count: then 1-row calls run the tiles (their bits, whatever the threshold); a rerun restores it."""
    from specrouter.models.runners.linear import amx_vector_verdict

    ops = _amx_ops()
    verdict = ops.amx_vector_check()
    assert verdict.startswith(("on: ", "off: ")) and "4096 float32 sums" in verdict, verdict
    assert amx_vector_verdict() == verdict and f"+amx-vector:{verdict[:verdict.index(':')]}" in kernels()
    g = torch.Generator().manual_seed(13)
    lin = Linear.pack((torch.randn(96, 576, generator=g) * 0.05).to(torch.bfloat16), kernel=_kernel("amx", torch.bfloat16))
    x = torch.randn(1, 576, generator=g).to(torch.bfloat16)
    before = ops.set_amx_vector_rows(0)
    try:
        tiles = ops.linear_amx_sums(x, lin.weight, 96)
        with caplog.at_level(logging.WARNING, logger="specrouter.models.runners.linear"):
            off = amx_vector_verdict(control=True)
        assert re.match(r"off: [1-9]\d* of 4096 float32 sums", off) and "the tiles run every row count" in off
        assert "its vector form is off" in caplog.text
        assert ops.amx_vector_check() == off and amx_vector_verdict() == off  # kept until rechecked
        assert "+amx-vector:off" in kernels()
        ops.set_amx_vector_rows(4)
        assert torch.equal(ops.linear_amx_sums(x, lin.weight, 96).view(torch.int32), tiles.view(torch.int32))
    finally:
        assert amx_vector_verdict(recheck=True) == verdict  # restored
        ops.set_amx_vector_rows(before)


def _causal(q_pos: torch.Tensor, groups: int, Lp: int) -> torch.Tensor:
    return torch.arange(Lp) <= q_pos.repeat(groups)[:, None]  # (groups*T, Lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_row_invariant_and_matches_sdpa(dtype):
    """Queries at positions 50..140 (crossing key chunks), 1 at a time vs 2-12 at a time,
    GQA rows as in the runner (3 query heads per KV head): bitwise the same; and close to SDPA."""
    g = torch.Generator().manual_seed(0)
    KV, groups, D, P = 3, 3, 64, 50
    Lmax = padded_length(160)
    keys = torch.randn(1, KV, Lmax, D, generator=g).to(dtype)
    values = torch.randn(1, KV, Lmax, D, generator=g).to(dtype)
    qs = torch.randn(1, KV, groups, 91, D, generator=g).to(dtype)  # positions P..P+90

    def run(lo: int, T: int) -> torch.Tensor:  # (KV, groups, T, D)
        Lp = padded_length(P + lo + T)
        q = qs[:, :, :, lo : lo + T].reshape(1, KV, groups * T, D)
        o = attention(q * D**-0.5, keys[:, :, :Lp], values[:, :, :Lp], blocked_keys(_causal(P + lo + torch.arange(T), groups, Lp)))
        return o.view(KV, groups, T, D)

    one = torch.cat([run(i, 1) for i in range(91)], dim=2)
    for T in (2, 3, 5, 9, 12):
        for lo in (0, 7, 10, 79):
            assert torch.equal(run(lo, T), one[:, :, lo : lo + T]), (T, lo)
    # the same function as SDPA, to rounding
    T, lo = 9, 10
    Lp, L = padded_length(P + lo + T), P + lo + T
    q = qs[:, :, :, lo : lo + T].reshape(1, KV, groups * T, D)
    ref = F.scaled_dot_product_attention(q.double(), keys[:, :, :L].double(), values[:, :, :L].double(),
                                         attn_mask=_causal(P + lo + torch.arange(T), groups, L))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(run(lo, T).double().reshape(ref.shape), ref, rtol=tol, atol=tol)
    assert Lmax % KEY_CHUNK == 0


def test_torch_row_policy_finds_the_padding_under_which_a_kernel_is_row_invariant(monkeypatch):
    """Negative controls for the run-time check: a kernel whose bits change below 16 rows gets
    its calls padded to multiples of 16; one whose bits follow the count of real (non-padding)
    rows runs one row per call; either way every row then has the bits of its 1-row call."""
    from specrouter.models.runners import linear as lin_mod

    def below_16(kernel, x, weight, bias, residual):  # weight (in, out) on MM
        y = torch.mm(x, weight) if x.shape[0] < 16 else (x.double() @ weight.double()).float()
        return y if residual is None else y + residual

    def every_count(kernel, x, weight, bias, residual):  # follows the rows that are not padding
        y = torch.mm(x, weight) * (1 + int(x.any(1).sum()) * 2.0**-20)
        return y if residual is None else y + residual

    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 96, generator=g)
    x = torch.randn(40, 96, generator=g)
    for fake, want in ((below_16, 16), (every_count, lin_mod.ROWWISE)):
        monkeypatch.setattr(lin_mod, "_raw", fake)
        assert not torch.equal(fake(MM, x[:1], w.t(), None, None), fake(MM, x[:20], w.t(), None, None)[:1])
        pad = lin_mod.row_policy.__wrapped__(MM, torch.float32, 96, 24, False)
        assert pad == want
        lin = Linear(w.t().contiguous(), None, MM, 24, pad)
        one = torch.cat([linear(x[i : i + 1], lin) for i in range(40)])
        for n in (2, 3, 5, 17, 33, 40):
            assert torch.equal(linear(x[40 - n :], lin), one[40 - n :]), n
