"""Linear layers on one row-invariant kernel per precision.

Exact speculative decoding needs a position's logits to be bitwise the same whether the target
computes it in a 1-token step, a k-token verification or a ragged multi-row batch. So every
linear of every forward, whatever its row count (1 included), runs ONE kernel per precision, a
kernel whose result for a row is bitwise independent of the other rows (tests/test_linear.py,
tests/test_row_invariance.py prove it on the shapes used):

- float32 and bfloat16: the project's own kernels (kernels/linear256.cpp on AVX2 + FMA,
  kernels/linear512.cpp on AVX-512 and AVX-512-BF16, kernels/linearamx.cpp's bfloat16 on AMX
  tiles, compiled on first use, chosen per kernel path): each output is one fixed sequence of FMAs over a weight packed once into tiles of
  outputs, float32 accumulation, one rounding at the end. Memory-bound for 1 row, and up to 6
  (AVX2) or 12 (AVX-512) rows share every weight load.
- where those kernels cannot run (no AVX2, no compiler, `SPECROUTER_KERNELS=torch`, or a
  bfloat16 input width that is odd): float32 on oneDNN's inner product over a
  weight reordered to its blocked layout (`torch.ops.mkldnn._linear_pointwise`), bfloat16 on
  oneDNN where this CPU has the instructions its bfloat16 reorder needs, else ATen's
  `F.linear`. None of torch's kernels promises row invariance, and which row counts break it
  depends on the CPU (oneDNN on an AVX-512 Zen 4 gives 1 row other bits than 2+ rows at an
  input width of 1536; MKL's GEMM switches to GEMV for one row). So a torch kernel runs only
  row counts it was CHECKED to be invariant on, here, at run time (`row_policy`): per (kernel,
  dtype, input width, bias), a call's rows are padded with zero rows to a multiple of `pad`,
  more than CHUNK rows run in CHUNK-row calls; `pad` is the smallest of PADS whose every row
  count (1..CHUNK) gives each row the bits of its 1-row call, else every row runs alone in a
  padded call of one fixed shape (invariant whenever the kernel is deterministic).
- float64 (the tests' reference precision): `torch.mm` on the (in, out) layout, under the same
  checked row policy (MKL's float64 GEMM on Zen 4 gives a row other bits at 5-7 rows than at 4).

The residual add after o_proj and down_proj is fused into the kernel (`linear_add`) the same
way at every row count, so it rounds the same way at every row count.

The kernel is chosen once per (dtype, device) at pack time; `kernels()` names the choices and
is part of the router's cost-profile fingerprint.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrouter.models.runners.attention import KEY_CHUNK, MIN_ROWS
from specrouter.models.runners.kernels import kernel_path, rowinv

log = logging.getLogger(__name__)
_ops = getattr(torch.ops, "mkldnn", None)
_rowinv = torch.ops.specrouter_rowinv  # its ops resolve at call time, once rowinv() built them


def _onednn_available(dtype: torch.dtype) -> bool:
    """True if this torch build and CPU run oneDNN's packed linear in `dtype`."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.ones(8, 4, dtype=dtype)
        packed = _ops._reorder_linear_weight(w, None)
        y = _ops._linear_pointwise(torch.ones(3, 4, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.equal(y, torch.full((3, 8), 4.0, dtype=dtype)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


ONEDNN = _onednn_available(torch.float32)
ONEDNN_BF16 = _onednn_available(torch.bfloat16)

# kernels, one per precision (on CPU): the native ones (linear256.cpp's AVX2 linear,
# linear512.cpp's AVX-512F one and its AVX-512-BF16 vdpbf16ps one, linearamx.cpp's AMX one),
# then torch's
ROWINV, ROWINV512, ROWINV_DP, ROWINV_AMX = "rowinv", "rowinv512", "rowinv512-dpbf16", "rowinv-amx-bf16"
ONEDNN_BLOCKED, ATEN_LINEAR, MM = "onednn-blocked", "aten-linear", "mm"
NATIVE_KERNELS = (ROWINV, ROWINV512, ROWINV_DP, ROWINV_AMX)
# the native kernel of each (path, dtype)
NATIVE_BY_PATH = {
    "amx": {torch.float32: ROWINV512, torch.bfloat16: ROWINV_AMX},
    "avx512bf16": {torch.float32: ROWINV512, torch.bfloat16: ROWINV_DP},
    "avx512": {torch.float32: ROWINV512, torch.bfloat16: ROWINV512},
    "avx2": {torch.float32: ROWINV, torch.bfloat16: ROWINV},
}
TRITON = "triton"  # the GPU path's batch-invariant matmul (runners/triton/matmul.py)
# outputs per packed tile (linear256.cpp, linear512.cpp, linearamx.cpp: the same tiles as linear512)
TILE = {ROWINV: 16, ROWINV512: 32, ROWINV_DP: 32, ROWINV_AMX: 32}
# the torch kernels, where rowinv cannot run
FALLBACK_BY_DTYPE = {
    torch.float32: ONEDNN_BLOCKED if ONEDNN else MM,
    torch.bfloat16: ONEDNN_BLOCKED if ONEDNN_BF16 else ATEN_LINEAR,
    torch.float64: MM,
}
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernels compute in
# torch kernels: candidate paddings (a call's rows are padded to a multiple of one; 2 and 3
# rows cost oneDNN ~1.4-2x 4 rows, so 4 is the least), the widest call, the probe's output cap
CHUNK = 32
PADS, PROBE_OUT = (4, 8, 16, CHUNK), 640
ROWWISE = 0  # a policy: every row alone, padded to PADS[0] rows


def kernel_for(dtype: torch.dtype, device: torch.device | str = "cpu", path: str | None = None) -> str:
    """The kernel every linear of a `dtype` model on `device` runs on kernel path `path` (default
    `kernel_path()`: the CPU's fastest, or SPECROUTER_KERNELS's); see `Linear.pack` for the one
    exception: an input width a native kernel's blocks do not divide."""
    path = path or kernel_path()
    if torch.device(device).type == "cpu" and path in NATIVE_BY_PATH and dtype in NATIVE_DTYPES and rowinv() is not None:
        return NATIVE_BY_PATH[path][dtype]
    return kernel_for_torch(dtype, device)


def kernel_for_torch(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The kernel of a `dtype` model on `device` on torch's kernels only (no native ones)."""
    if torch.device(device).type != "cpu":
        return ATEN_LINEAR
    return FALLBACK_BY_DTYPE.get(dtype, MM)


def amx_vector_verdict(recheck: bool = False, control: bool = False) -> str:
    """The amx path's few-row form (kernels/linearamx.cpp `run_vector`: AVX-512 FMAs that compute
    what tdpbf16ps computes, so 1- and 2-row calls need not run the tiles) runs only where its
    self-check, once a process before the first AMX linear, gave the tiles' float32 sums bit for
    bit on this CPU: "on: ..." or "off: <how many sums differed> ..." (then the tiles run every
    row count; a warning is logged); "" where the amx path does not run here. Recorded in
    `kernels()`. recheck: run the check again; control: on a vector form that rounds otherwise
    (the tests' negative control; a recheck without it restores the verdict)."""
    if kernel_for(torch.bfloat16) != ROWINV_AMX:
        return ""
    global _amx_verdict
    if _amx_verdict is None or recheck or control:
        _amx_verdict = _rowinv.amx_vector_check(recheck, control)
        if not _amx_verdict.startswith("on"):
            log.warning("kernel path amx: its vector form is %s", _amx_verdict)
    return _amx_verdict


_amx_verdict: str | None = None


def kernels() -> str:
    """The kernels of the linears and attention: part of the cost-profile fingerprint, so
    timings swept under other kernels are not reused. On the amx path it names whether the
    1-2 row vector form runs (`amx_vector_verdict`)."""
    attn = "rowinv" if rowinv() is not None else f"chunk{KEY_CHUNK}rows{MIN_ROWS}"
    verdict = amx_vector_verdict()
    return "{}:fp32:{}+bf16:{}+rows-checked{}+attn:{}{}".format(
        kernel_path(), kernel_for(torch.float32), kernel_for(torch.bfloat16), CHUNK, attn,
        f"+amx-vector:{verdict.split(':')[0]}" if verdict else "",
    )


def _raw(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         residual: torch.Tensor | None) -> torch.Tensor:
    """One call of a torch kernel as it is, no row policy: x (N, in) -> (N, out)."""
    if kernel == ONEDNN_BLOCKED:
        if residual is None:
            return _ops._linear_pointwise(x, weight, bias, "none", [], "")
        return _ops._linear_pointwise(x, residual, weight, bias, "add")
    if kernel == ATEN_LINEAR:
        if residual is None:
            return F.linear(x, weight, bias)
        weight = weight.t()  # (in, out)
    if residual is None:
        return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
    y = torch.addmm(residual, x, weight)
    return y if bias is None else y.add_(bias)


def _pack_torch(kernel: str, weight: torch.Tensor) -> torch.Tensor:
    if kernel == ONEDNN_BLOCKED:
        return _ops._reorder_linear_weight(weight.contiguous(), None)
    if kernel == ATEN_LINEAR:
        return weight.contiguous()
    return weight.t().contiguous()


def _padded(kernel: str, pad: int, x, weight, bias, residual) -> torch.Tensor:
    """A call of at most CHUNK rows, padded with zero rows to a multiple of `pad` rows."""
    n = x.shape[0]
    if n % pad == 0:
        return _raw(kernel, x, weight, bias, residual)
    grow = (0, 0, 0, -n % pad)
    return _raw(kernel, F.pad(x, grow), weight, bias, None if residual is None else F.pad(residual, grow))[:n]


def _run_torch(kernel: str, pad: int, x, weight, bias, residual) -> torch.Tensor:
    """x (N, in) -> (N, out) under the row policy `pad` (ROWWISE: one row per call)."""
    step = CHUNK if pad != ROWWISE else 1
    pad = pad or PADS[0]
    if x.shape[0] <= step:
        return _padded(kernel, pad, x, weight, bias, residual)
    return torch.cat([
        _padded(kernel, pad, x[i : i + step], weight, bias, None if residual is None else residual[i : i + step])
        for i in range(0, x.shape[0], step)
    ])


@functools.cache
def row_policy(kernel: str, dtype: torch.dtype, in_features: int, out_features: int, bias: bool) -> int:
    """The least of PADS such that `kernel`, its calls padded to a multiple of that many rows,
    gives every row the bits of its 1-row call, checked here on random data of the layer's input width (outputs capped at
    PROBE_OUT), plain and residual-fused, for every row count 1..CHUNK, each at the start and
    the end of the rows; ROWWISE if none does."""
    g = torch.Generator().manual_seed(in_features)
    out_f = min(out_features, PROBE_OUT)
    w = torch.randn(out_f, in_features, generator=g, dtype=torch.float64).mul_(in_features**-0.5).to(dtype)
    b = torch.randn(out_f, generator=g, dtype=torch.float64).to(dtype) if bias else None
    x = torch.randn(CHUNK, in_features, generator=g, dtype=torch.float64).to(dtype)
    r = torch.randn(CHUNK, out_f, generator=g, dtype=torch.float64).to(dtype)
    packed = _pack_torch(kernel, w)
    for pad in PADS:
        one = torch.cat([_padded(kernel, pad, x[i : i + 1], packed, b, None) for i in range(CHUNK)])
        one_add = torch.cat([_padded(kernel, pad, x[i : i + 1], packed, b, r[i : i + 1]) for i in range(CHUNK)])
        if all(
            torch.equal(_padded(kernel, pad, x[lo : lo + n], packed, b, None), one[lo : lo + n])
            and torch.equal(_padded(kernel, pad, x[lo : lo + n], packed, b, r[lo : lo + n]), one_add[lo : lo + n])
            for n in range(2, CHUNK + 1)
            for lo in {0, CHUNK - n}
        ):
            return pad
    log.warning("torch's %s linear (%s, input width %d) is not row-invariant under any padding here; "
                "running one row per call", kernel, dtype, in_features)
    return ROWWISE


def pack_tiles(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """(out, in) -> the native linears' tiles of `tile` outputs: float32 (ceil(out/tile), in,
    tile), bfloat16 (ceil(out/tile), in/2, tile, 2) (the pair k, k+1 of an output side by side),
    padding outputs zero."""
    out_f, in_f = weight.shape
    w = F.pad(weight, (0, 0, 0, -out_f % tile))  # (ceil(out), in)
    if weight.dtype == torch.float32:
        return w.view(-1, tile, in_f).transpose(1, 2).contiguous()
    return w.view(-1, tile, in_f // 2, 2).transpose(1, 2).contiguous()


def _fits(dtype: torch.dtype, in_f: int) -> bool:
    """Whether the native kernels take an input width of in_f (bfloat16 reads pairs)."""
    return dtype == torch.float32 or in_f % 2 == 0


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear layer, y = x @ W.T + b, its weight in the layout of its kernel."""

    weight: torch.Tensor  # native: pack_tiles's (TILE[kernel]); onednn-blocked: opaque blocked;
    #                       aten-linear, triton: (out, in); mm: (in, out)
    bias: torch.Tensor | None  # (out,)
    kernel: str  # NATIVE_KERNELS | ONEDNN_BLOCKED | ATEN_LINEAR | MM | TRITON
    out_features: int
    pad: int = 0  # torch kernels: the row policy (`row_policy`); rowinv: unused

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None) -> "Linear":
        """From a checkpoint's (out, in) weight; `kernel` (tests, benchmarks) overrides the
        choice of `kernel_for`."""
        kernel = kernel or kernel_for(weight.dtype, weight.device)
        out_f, in_f = weight.shape
        if kernel in NATIVE_KERNELS and not _fits(weight.dtype, in_f):
            kernel = FALLBACK_BY_DTYPE[weight.dtype]
        if kernel in NATIVE_KERNELS:
            if rowinv() is None:
                raise RuntimeError(f"kernel {kernel!r}: the native kernels are not available here")
            if kernel == ROWINV_AMX:
                amx_vector_verdict()  # the vector form's self-check, once, at load (a warning if off)
            packed = pack_tiles(weight.contiguous(), TILE[kernel])
            return Linear(packed, None if bias is None else bias.contiguous(), kernel, out_f)
        if kernel == TRITON:  # (out, in) as in the checkpoint; invariant by construction
            return Linear(weight.contiguous(), bias, kernel, out_f)
        pad = row_policy(kernel, weight.dtype, in_f, out_f, bias is not None) if weight.device.type == "cpu" else PADS[0]
        return Linear(_pack_torch(kernel, weight), bias, kernel, out_f, pad)


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x (N, in) -> (N, out), the same bits for a row whatever N."""
    if w.kernel == ROWINV:
        return _rowinv.linear(x, w.weight, w.out_features, w.bias, None)
    if w.kernel == TRITON:
        return _triton_linear(x, w.weight, w.bias)
    if w.kernel == ROWINV_AMX:
        return _rowinv.linear_amx(x, w.weight, w.out_features, w.bias, None)
    if w.kernel in NATIVE_KERNELS:
        return _rowinv.linear512(x, w.weight, w.out_features, w.bias, None, w.kernel == ROWINV_DP)
    return _run_torch(w.kernel, w.pad, x, w.weight, w.bias, None)


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: Linear) -> torch.Tensor:
    """residual + linear(x), the add fused into the kernel (one rounding in bfloat16)."""
    if w.kernel == ROWINV:
        return _rowinv.linear(x, w.weight, w.out_features, w.bias, residual)
    if w.kernel == TRITON:
        return _triton_linear(x, w.weight, w.bias, residual)
    if w.kernel == ROWINV_AMX:
        return _rowinv.linear_amx(x, w.weight, w.out_features, w.bias, residual)
    if w.kernel in NATIVE_KERNELS:
        return _rowinv.linear512(x, w.weight, w.out_features, w.bias, residual, w.kernel == ROWINV_DP)
    return _run_torch(w.kernel, w.pad, x, w.weight, w.bias, residual)


def _triton_linear(x, weight, bias, residual=None):
    from specrouter.models.runners.triton.matmul import linear as triton_linear

    return triton_linear(x, weight, bias, residual)
