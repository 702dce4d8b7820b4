"""Linear layers on one row-invariant kernel per precision.

Exact speculative decoding needs a position's logits to be bitwise the same whether the target
computes it in a 1-token step, a k-token verification or a ragged multi-row batch. So every
linear of every forward, whatever its row count (1 included), runs ONE kernel per precision, a
kernel whose result for a row is bitwise independent of the other rows (tests/test_linear.py,
tests/test_row_invariance.py prove it on the shapes used):

- float32: oneDNN's inner product on a weight reordered once to its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the kernels torch.compile's
  CPU backend uses). Memory-bound and flat from 1 to ~8 rows. 2 and 3 rows are slow (~1.5-2x 4
  rows), so they are padded to 4 (row-invariance makes the padding rows harmless). MKL's GEMM
  (`torch.mm`) is NOT used: its bits for a row change with the row count (GEMV for one row), and
  over 2-8 rows it costs 2-4x one row.
- bfloat16: the same oneDNN kernel where this CPU has the instructions its bfloat16 reorder
  needs (AVX512-BW/VL/DQ or AVX-NE-CONVERT); elsewhere (AVX2) ATen's `F.linear`, whose bfloat16
  GEMM computes each output as its own float32 dot product.
- float64 (the tests' reference precision): `torch.mm` on the (in, out) layout.

The residual add after o_proj and down_proj is fused into the kernel (`linear_add`) the same
way at every row count, so it rounds the same way at every row count.

The kernel is chosen once per (dtype, device) at pack time: `KERNELS` names the choices and is
part of the router's cost-profile fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrouter.models.runners.attention import KEY_CHUNK, MIN_ROWS

_ops = getattr(torch.ops, "mkldnn", None)


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
ONEDNN_BLOCKED, ATEN_LINEAR, MM = "onednn-blocked", "aten-linear", "mm"
KERNEL_BY_DTYPE = {
    torch.float32: ONEDNN_BLOCKED if ONEDNN else MM,
    torch.bfloat16: ONEDNN_BLOCKED if ONEDNN_BF16 else ATEN_LINEAR,
    torch.float64: MM,
}
# row counts oneDNN handles badly: 2 and 3 rows cost ~1.4-2x 4 rows, so they are padded to 4
PAD_TO = 4
# part of the cost-profile fingerprint (linears and attention): timings swept under other
# kernels are not reused
KERNELS = "fp32:{}+bf16:{}+pad{}/3+attn:chunk{}rows{}".format(
    KERNEL_BY_DTYPE[torch.float32], KERNEL_BY_DTYPE[torch.bfloat16], PAD_TO, KEY_CHUNK, MIN_ROWS
)


def kernel_for(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The kernel every linear of a `dtype` model on `device` runs."""
    if torch.device(device).type != "cpu":
        return ATEN_LINEAR
    return KERNEL_BY_DTYPE.get(dtype, MM)


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear layer, y = x @ W.T + b, its weight in the layout of its kernel."""

    weight: torch.Tensor  # onednn-blocked: opaque blocked; aten-linear: (out, in); mm: (in, out)
    bias: torch.Tensor | None  # (out,)
    kernel: str  # ONEDNN_BLOCKED | ATEN_LINEAR | MM

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        """From a checkpoint's (out, in) weight."""
        kernel = kernel_for(weight.dtype, weight.device)
        if kernel == ONEDNN_BLOCKED:
            packed = _ops._reorder_linear_weight(weight.contiguous(), None)
        elif kernel == ATEN_LINEAR:
            packed = weight.contiguous()
        else:
            packed = weight.t().contiguous()
        return Linear(packed, bias, kernel)


def _pad(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, PAD_TO - x.shape[0]))


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x (N, in) -> (N, out), the same bits for a row whatever N."""
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
    if w.kernel == ONEDNN_BLOCKED:
        n = x.shape[0]
        if 1 < n < PAD_TO:
            return _ops._linear_pointwise(_pad(x), _pad(residual), w.weight, w.bias, "add")[:n]
        return _ops._linear_pointwise(x, residual, w.weight, w.bias, "add")
    weight = w.weight.t() if w.kernel == ATEN_LINEAR else w.weight  # (in, out)
    y = torch.addmm(residual, x, weight)
    return y if w.bias is None else y.add_(w.bias)
