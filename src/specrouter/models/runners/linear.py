"""Linear layers on one row-invariant kernel per precision.

Exact speculative decoding needs a position's logits to be bitwise the same whether the target
computes it in a 1-token step, a k-token verification or a ragged multi-row batch. So every
linear of every forward, whatever its row count (1 included), runs ONE kernel per precision, a
kernel whose result for a row is bitwise independent of the other rows (tests/test_linear.py,
tests/test_row_invariance.py prove it on the shapes used):

- float32 and bfloat16: the project's own kernel (kernels/rowinv.cpp, AVX2 + FMA, compiled on
  first use): each output is one fixed sequence of FMAs over a weight packed once into a
  streaming layout, float32 accumulation, one rounding at the end. Memory-bound for 1 row
  (1.7-1.8x faster than oneDNN and MKL on this project's AVX2 machine), and 2-8 rows share
  every weight load.
- where that kernel cannot run (no AVX2, no compiler, `SPECROUTER_KERNELS=torch`, or an input
  width that is not a whole number of its blocks): float32 on oneDNN's inner product over a
  weight reordered to its blocked layout (`torch.ops.mkldnn._linear_pointwise`; 2 and 3 rows
  padded to 4, which it handles badly), bfloat16 on oneDNN where this CPU has the instructions
  its bfloat16 reorder needs, else ATen's `F.linear`. MKL's GEMM (`torch.mm`) is not used for
  them: its bits for a row change with the row count (GEMV for one row).
- float64 (the tests' reference precision): `torch.mm` on the (in, out) layout.

The residual add after o_proj and down_proj is fused into the kernel (`linear_add`) the same
way at every row count, so it rounds the same way at every row count.

The kernel is chosen once per (dtype, device) at pack time; `kernels()` names the choices and
is part of the router's cost-profile fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrouter.models.runners.attention import KEY_CHUNK, MIN_ROWS
from specrouter.models.runners.kernels import rowinv

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

# kernels, one per precision (on CPU)
ROWINV, ONEDNN_BLOCKED, ATEN_LINEAR, MM = "rowinv", "onednn-blocked", "aten-linear", "mm"
# the torch kernels, where rowinv cannot run
FALLBACK_BY_DTYPE = {
    torch.float32: ONEDNN_BLOCKED if ONEDNN else MM,
    torch.bfloat16: ONEDNN_BLOCKED if ONEDNN_BF16 else ATEN_LINEAR,
    torch.float64: MM,
}
# rowinv's weight block (elements per 32-byte load): the input width must be a multiple
ROWINV_BLOCK = {torch.float32: 8, torch.bfloat16: 16}
# row counts oneDNN handles badly: 2 and 3 rows cost ~1.4-2x 4 rows, so they are padded to 4
PAD_TO = 4


def kernel_for(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The kernel every linear of a `dtype` model on `device` runs (see `Linear.pack` for the
    one exception: an input width rowinv's blocks do not divide)."""
    if torch.device(device).type == "cpu" and dtype in ROWINV_BLOCK and rowinv() is not None:
        return ROWINV
    return kernel_for_torch(dtype, device)


def kernel_for_torch(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The kernel of a `dtype` model on `device` on torch's kernels only (no native ones)."""
    if torch.device(device).type != "cpu":
        return ATEN_LINEAR
    return FALLBACK_BY_DTYPE.get(dtype, MM)


def kernels() -> str:
    """The kernels of the linears and attention: part of the cost-profile fingerprint, so
    timings swept under other kernels are not reused."""
    attn = "rowinv" if rowinv() is not None else f"chunk{KEY_CHUNK}rows{MIN_ROWS}"
    return "fp32:{}+bf16:{}+pad{}/3+attn:{}".format(
        kernel_for(torch.float32), kernel_for(torch.bfloat16), PAD_TO, attn
    )


def pack_rowinv(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> rowinv's streaming layout (ceil(out/4), in/B, 4, B): 4 outputs' blocks of
    B elements side by side, padding outputs zero."""
    out_f, in_f = weight.shape
    block = ROWINV_BLOCK[weight.dtype]
    w = F.pad(weight, (0, 0, 0, -out_f % 4))  # (ceil4(out), in)
    return w.view(-1, 4, in_f // block, block).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear layer, y = x @ W.T + b, its weight in the layout of its kernel."""

    weight: torch.Tensor  # rowinv: pack_rowinv's; onednn-blocked: opaque blocked;
    #                       aten-linear: (out, in); mm: (in, out)
    bias: torch.Tensor | None  # (out,)
    kernel: str  # ROWINV | ONEDNN_BLOCKED | ATEN_LINEAR | MM
    out_features: int

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None) -> "Linear":
        """From a checkpoint's (out, in) weight; `kernel` (tests, benchmarks) overrides the
        choice of `kernel_for`."""
        kernel = kernel or kernel_for(weight.dtype, weight.device)
        out_f, in_f = weight.shape
        if kernel == ROWINV and in_f % ROWINV_BLOCK[weight.dtype]:
            kernel = FALLBACK_BY_DTYPE[weight.dtype]
        if kernel == ROWINV:
            packed = pack_rowinv(weight.contiguous())
            bias = None if bias is None else bias.contiguous()
        elif kernel == ONEDNN_BLOCKED:
            packed = _ops._reorder_linear_weight(weight.contiguous(), None)
        elif kernel == ATEN_LINEAR:
            packed = weight.contiguous()
        else:
            packed = weight.t().contiguous()
        return Linear(packed, bias, kernel, out_f)


def _pad(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, PAD_TO - x.shape[0]))


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x (N, in) -> (N, out), the same bits for a row whatever N."""
    if w.kernel == ROWINV:
        return _rowinv.linear(x, w.weight, w.out_features, w.bias, None)
    if w.kernel == ONEDNN_BLOCKED:
        n = x.shape[0]
        if 1 < n < PAD_TO:
            return _ops._linear_pointwise(_pad(x), w.weight, w.bias, "none", [], "")[:n]
        return _ops._linear_pointwise(x, w.weight, w.bias, "none", [], "")
    if w.kernel == ATEN_LINEAR:
        return F.linear(x, w.weight, w.bias)
    return torch.mm(x, w.weight) if w.bias is None else torch.addmm(w.bias, x, w.weight)


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: Linear) -> torch.Tensor:
    """residual + linear(x), the add fused into the kernel (one rounding in bfloat16)."""
    if w.kernel == ROWINV:
        return _rowinv.linear(x, w.weight, w.out_features, w.bias, residual)
    if w.kernel == ONEDNN_BLOCKED:
        n = x.shape[0]
        if 1 < n < PAD_TO:
            return _ops._linear_pointwise(_pad(x), _pad(residual), w.weight, w.bias, "add")[:n]
        return _ops._linear_pointwise(x, residual, w.weight, w.bias, "add")
    weight = w.weight.t() if w.kernel == ATEN_LINEAR else w.weight  # (in, out)
    y = torch.addmm(residual, x, weight)
    return y if w.bias is None else y.add_(w.bias)
