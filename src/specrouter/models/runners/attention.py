"""Row-invariant attention over the slot cache: a query's output has the same bits whatever the
other queries of the forward (a 1-token step, a k-token verification, a ragged batch).

`F.scaled_dot_product_attention` does not have that property on CPU (its blocking follows the
query count), nor does a plain `q @ k.T` on MKL: the bits of a row change when the GEMM has
fewer than 4 rows, when its column count changes remainder class, and, for `p @ v`, when the
reduction length changes blocking. So every GEMM here has a shape that the query count and the
context length do not reach into (measured row-invariant on this project's CPUs; proven for the
runner's shapes by tests/test_row_invariance.py):

- the queries of a (row, KV head) are at least MIN_ROWS rows (zero rows pad 1-3 queries);
- keys are taken in whole chunks of KEY_CHUNK positions; keys past a query's position, including
  whatever an earlier, rolled-back forward left in the cache, are masked to -inf;
- `probs @ values` runs per chunk (reduction length KEY_CHUNK), and the chunks' partial outputs
  are summed in order; a chunk wholly after a query adds exact zeros to it.

Softmax runs in float32 (float64 for float64 models) and its probabilities are cast back to the
model dtype before `@ values`, as transformers' eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_CHUNK = 64  # keys per chunk; cache lengths are allocated in whole chunks
MIN_ROWS = 4  # fewer query rows take another GEMM path


def padded_length(n: int) -> int:
    """`n` keys rounded up to whole chunks."""
    return -(-n // KEY_CHUNK) * KEY_CHUNK


def blocked_keys(mask: torch.Tensor) -> torch.Tensor:
    """From a forward's mask (..., M, Lp) (True: attend), what `attention` takes, once per
    forward rather than per layer: True where a key is hidden, at least MIN_ROWS query rows
    (the padding rows attend everything, so no NaN, and are dropped after)."""
    M = mask.shape[-2]
    return ~(mask if M >= MIN_ROWS else F.pad(mask, (0, 0, 0, MIN_ROWS - M), value=True))


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """q (B, KV, M, D), already scaled by 1/sqrt(D); keys / values (B, KV, Lp, D) with Lp a
    multiple of KEY_CHUNK; `blocked` from `blocked_keys`, broadcastable to (B, KV,
    max(M, MIN_ROWS), Lp) -> (B, KV, M, D)."""
    B, KV, M, D = q.shape
    Lp = keys.shape[2]
    if M < MIN_ROWS:
        q = F.pad(q, (0, 0, 0, MIN_ROWS - M))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q, keys.transpose(-1, -2))  # (B, KV, M', Lp)
    probs = scores.masked_fill_(blocked, float("-inf")).softmax(-1, dtype=acc).to(q.dtype)
    nc = Lp // KEY_CHUNK
    if nc == 1:
        out = torch.matmul(probs, values)  # (B, KV, M', D)
    else:
        Mp = probs.shape[2]
        chunks = probs.view(B, KV, Mp, nc, KEY_CHUNK).transpose(2, 3)  # (B, KV, nc, M', C)
        partial = torch.matmul(chunks, values.view(B, KV, nc, KEY_CHUNK, D))  # (B, KV, nc, M', D)
        out = partial.sum(2)  # (B, KV, M', D), chunks in order
    return out[:, :, :M] if out.shape[2] != M else out
