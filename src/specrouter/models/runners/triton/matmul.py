"""Batch-invariant linear layer: y = x @ W.T (+ bias) (+ residual) on a Triton kernel.

Fixed tiles: every program computes a BLOCK_M x BLOCK_N tile of y over K in BLOCK_K steps, in
order, with one float32 accumulator per output; the launch configuration (tiles, warps, stages)
never depends on M, and K is never split. So row i's outputs are the same instruction sequence
whether x has 1 row or 40, and whether row i sits first or last in its tile: bitwise invariant.
Inputs are float32 (`ieee` products, no TF32) or bfloat16 (widened to float32 in registers, TF32
products, exact for bf16 values); float32 accumulation; the result is rounded once to the input
dtype, the residual added before that rounding (as the CPU kernels do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # fixed: never chosen by shape (that is the invariance)
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K,
                   stride_xm, stride_wn, stride_rm, stride_ym,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)  # (BM,) rows of x / y
    rn = pid_n * BN + tl.arange(0, BN)  # (BN,) rows of W = columns of y
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # the K loop: fixed steps, in order, never split
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)  # (BM, BK)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0).to(tl.float32)  # (BK, BN)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :],
                       mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K) (a checkpoint's layout), bias (N,), residual (M, N) -> (M, N) in
    x's dtype (float32 or bfloat16); each row's bits independent of M and of the other rows."""
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        raise TypeError(f"the Triton linear takes float32 or bfloat16, got {x.dtype} x {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else y, residual if residual is not None else y, y, M, N, K,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        # float32: full-precision products; bfloat16 (loaded as is, widened in registers): TF32
        # tensor cores, exact for bf16 values (TF32 keeps 10 mantissa bits, bf16 has 7)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
