"""Batch-invariant causal attention over the runner's slot cache.

One program per (row b, query head h, new token t): it reads the cache of slot `slots[b]`
(KV head h // groups) in fixed blocks of KV_BLOCK positions, keys 0 .. starts[b] + t in order,
with an online softmax in float32. The KV split is a fixed SIZE (not a number of splits chosen
from the batch), so a query's output is the same sequence of operations whatever the batch, the
row count and the number of new tokens: bitwise invariant. Queries are already scaled by
1/sqrt(head_dim) (the runner folds the scale into q's weights). Padding tokens (t >=
num_tokens[b]) attend as the row's last valid token does (their output is dropped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_BLOCK = 64  # keys per step of the key loop: fixed, the invariance rests on it


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, starts_ptr, nums_ptr,
                      T, NH, GROUPS, D,
                      sq_b, sq_t, sq_h, sk_s, sk_h, sk_p, so_b, so_t, so_h,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // (T * NH)
    t = (pid // NH) % T
    h = pid % NH
    slot = tl.load(slots_ptr + b)
    num = tl.load(nums_ptr + b)
    last = tl.load(starts_ptr + b) + tl.minimum(t, num - 1)  # the last key this query sees
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + t * sq_t + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
    base = slot * sk_s + (h // GROUPS) * sk_h
    m_i = tl.zeros([1], dtype=tl.float32) - float("inf")  # running max of the scores
    l_i = tl.zeros([1], dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for p0 in range(0, last + 1, BLOCK_N):  # fixed-size key blocks, in order
        pos = p0 + n
        pmask = pos <= last
        offs = base + pos[:, None] * sk_p + d[None, :]
        k = tl.load(k_ptr + offs, mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)  # (BLOCK_N,)
        s = tl.where(pmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + offs, mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(o_ptr + b * so_b + t * so_t + h * so_h + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              starts: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """q (B, T, NH, D) (any strides, last dim contiguous), caches (S, KV, P, D) holding the new
    tokens' keys and values already, slots / starts / num_tokens (B,) int64 -> (B, T, NH, D)."""
    B, T, NH, D = q.shape
    KV = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    o = torch.empty(B, T, NH, D, dtype=q.dtype, device=q.device)
    _attention_kernel[(B * T * NH,)](
        q, k_cache, v_cache, o, slots, starts, num_tokens, T, NH, NH // KV, D,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        BLOCK_N=KV_BLOCK, BLOCK_D=triton.next_power_of_2(D), num_warps=2)
    return o
