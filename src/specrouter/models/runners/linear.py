"""Linear layers in the layouts their calls want: one row, or a few rows.

Measured on this project's CPU (AMD EPYC, one core; SmolLM2-135M shapes, weights streamed from
DRAM as in a real forward; see benchmarks/runner_micro.py):

- MKL's float32 GEMM over 2-8 rows costs 2-4x one row, and unevenly (3 rows slower than 4). A
  k-token verification step therefore cost ~1.7x a 1-token step, which ate most of what
  speculative decoding saves.
- oneDNN's float32 inner product on a weight reordered once to its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the kernels torch.compile's
  CPU backend uses) is flat from 1 to ~8 rows: memory-bound, as a GEMM of a few rows should be.
  It is also row-invariant: each row's result is bitwise the same whatever the other rows.
  Except that 2 and 3 rows are slow (~1.5-2x 4 rows), so they are padded to 4.
- For exactly one row, MKL's GEMV on the (in, out) contiguous layout is the fastest (~1.3x
  oneDNN), so a 1-row call keeps using it.

So float32 weights are kept twice, (in, out) contiguous for one row and oneDNN-blocked for more
(2x the weight memory of the linear layers: 1 GB instead of 0.5 GB for a 135M model). Other
dtypes, and builds without oneDNN, use the (in, out) layout for every call. The choice is made
once per forward from the row count, a Python int: no per-call probing on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_ops = getattr(torch.ops, "mkldnn", None)


def _onednn_available() -> bool:
    """True if this torch build has the oneDNN packed-linear ops and they run."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.ones(8, 4)
        packed = _ops._reorder_linear_weight(w, None)
        y = _ops._linear_pointwise(torch.ones(3, 4), packed, None, "none", [], "")
        return bool(torch.equal(y, torch.full((3, 8), 4.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


ONEDNN = _onednn_available()
# part of the cost-profile fingerprint: timings swept under other kernels are not reused
KERNELS = "mkl-row+onednn-rows-pad4/2" if ONEDNN else "mkl/1"


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear layer, y = x @ W.T + b, with its weight in the layouts its calls use."""

    row: torch.Tensor  # (in, out), contiguous except in bfloat16: torch.mm(x, row), any rows
    rows: torch.Tensor | None  # oneDNN-blocked (out, in) for 2+ rows; None: use `row`
    bias: torch.Tensor | None  # (out,)

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        """From a checkpoint's (out, in) weight."""
        blocked = None
        if ONEDNN and weight.dtype == torch.float32 and weight.device.type == "cpu":
            blocked = _ops._reorder_linear_weight(weight.contiguous(), None)
        # bfloat16 goes to oneDNN either way, which reads the (out, in) layout as is
        row = weight.t() if weight.dtype == torch.bfloat16 else weight.t().contiguous()
        return Linear(row, blocked, bias)


# row counts oneDNN's float32 kernel handles badly: 2 and 3 rows cost ~1.4-2x 4 rows here, so
# they are padded to PAD_TO rows (row-invariance makes the padding rows harmless)
PAD_TO = 4

ONE_ROW, ROWS, PADDED = 0, 1, 2  # how a forward's linears run, from its row count


def row_mode(n: int) -> int:
    """The mode of every linear of a forward over `n` rows (a Python int: no sync)."""
    return ONE_ROW if n == 1 else PADDED if n < PAD_TO else ROWS


def linear(x: torch.Tensor, w: Linear, mode: int) -> torch.Tensor:
    """x (N, in) -> (N, out); `mode` = row_mode(N)."""
    if mode == ONE_ROW or w.rows is None:
        return torch.mm(x, w.row) if w.bias is None else torch.addmm(w.bias, x, w.row)
    if mode == PADDED:
        n = x.shape[0]
        return _ops._linear_pointwise(F.pad(x, (0, 0, 0, PAD_TO - n)), w.rows, w.bias, "none", [], "")[:n]
    return _ops._linear_pointwise(x, w.rows, w.bias, "none", [], "")


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: Linear, mode: int) -> torch.Tensor:
    """residual + linear(x): the residual add fused into the kernel where it can be."""
    if mode == ONE_ROW or w.rows is None:
        y = torch.addmm(residual, x, w.row)
        return y if w.bias is None else y.add_(w.bias)
    if mode == ROWS and w.bias is None:
        return _ops._linear_pointwise(x, residual, w.rows, None, "add")
    return residual + linear(x, w, mode)
