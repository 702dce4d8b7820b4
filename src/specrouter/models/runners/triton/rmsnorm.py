"""Batch-invariant RMSNorm: one program per row, the whole row in one block (a fixed reduction
tree for the row's width, whatever the row count). As transformers: normalize in float32, round
to the model dtype, then multiply by the weight (one more rounding in bfloat16)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32)  # transformers: cast, then weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> (..., H), x * rsqrt(mean(x^2) + eps) * weight, row by row."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, H, x2.stride(0), y.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(H), num_warps=4)
    return y.view(x.shape)
