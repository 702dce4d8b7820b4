"""Counter-based sampling noise on the GPU: decoding/noise.py's `coupled_argmax` in ONE launch.

The torch path costs ~100 small ops per call (each a kernel launch) and two host syncs (its NaN
check and its "look further" step); on a GPU that made seeded sampling cost twice greedy's time
per token. Here one program per row computes the same function (decoding/noise.py's docstring has
the derivation): token v of noise block b (BLOCK tokens; the vocabulary padded with -inf) gets

    E_v = M_b + (v is the block's argmin ? 0 : -log U(key, "token", v)),
    M_b = -log U(key, "block_min", b) / BLOCK,

with the same 32-bit hash (uint32 arithmetic: products wrap mod 2^32, as the reference's masked
int64 ones) and float64 logs, and the row samples argmax_v scores[v] - log E_v (ties: the first
index, as torch.argmax). Two passes over the row, in tiles of TILE_BLOCKS noise blocks:
1. every block's bound max(scores in b) - log M_b (no token of b scores above it): the block with
   the largest bound is evaluated exactly, giving a first best score;
2. every tile holding a block whose bound reaches the best so far is evaluated exactly, in order.
A skipped block's bound is below the best, so none of its tokens can win or tie: the result is
the full argmax, usually after one or two tiles of noise instead of the whole vocabulary.

No host sync: a row with a NaN score gets the token -1 (the torch path raises there, which needs
the host); the caller raises where the tokens reach the host anyway (decoding/executor.py).

The hash constants are arguments (decoding/noise.py owns them; this layer cannot import it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_BLOCKS = 32  # noise blocks per tile: 32 x 64 = 2048 tokens per loop step
NUM_WARPS = 8


@triton.jit
def _mix32(x, M1: tl.constexpr, M2: tl.constexpr):
    """lowbias32 on uint32 (products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * M1
    x = x ^ (x >> 15)
    x = x * M2
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, stream, counter, M1: tl.constexpr, M2: tl.constexpr, GOLDEN: tl.constexpr):
    """float64 uniforms in (0, 1) of (key, stream, counter): key uint32 scalar, counter uint32."""
    x = _mix32(key ^ stream, M1, M2)
    x = _mix32(x + counter * GOLDEN, M1, M2)
    x = _mix32(x ^ key, M1, M2)
    return (x.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)


@triton.jit
def _bounds(s_row, key, tile, V, rb, j, S_MIN: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
            GOLDEN: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr):
    """The tile's scores (TB, BLOCK) float64 (-inf past V), its blocks (TB,), their minima M_b
    (TB,) and bounds max(scores in b) - log M_b (TB,)."""
    blocks = tile * TB + rb  # (TB,)
    v = blocks[:, None] * BLOCK + j[None, :]  # (TB, BLOCK)
    s = tl.load(s_row + v, mask=v < V, other=float("-inf")).to(tl.float64)  # (TB, BLOCK)
    minima = -tl.log(_uniform(key, S_MIN, blocks.to(tl.uint32), M1, M2, GOLDEN)) / BLOCK  # (TB,)
    return s, blocks, minima, tl.max(s, 1) - tl.log(minima)


@triton.jit
def _noisy(s, key, blocks, minima, j, S_TOKEN: tl.constexpr, S_ARG: tl.constexpr, M1: tl.constexpr,
           M2: tl.constexpr, GOLDEN: tl.constexpr, BLOCK: tl.constexpr):
    """scores - log E_v of the blocks' tokens: s (R, BLOCK), blocks (R,), minima (R,) -> (R, BLOCK)."""
    v = blocks[:, None] * BLOCK + j[None, :]  # (R, BLOCK)
    extra = -tl.log(_uniform(key, S_TOKEN, v.to(tl.uint32), M1, M2, GOLDEN))  # (R, BLOCK)
    arg = tl.minimum((_uniform(key, S_ARG, blocks.to(tl.uint32), M1, M2, GOLDEN) * BLOCK).to(tl.int32),
                     BLOCK - 1)  # (R,)
    extra = tl.where(j[None, :] == arg[:, None], 0.0, extra)
    return s - tl.log(minima[:, None] + extra)


@triton.jit
def _first_max(x, idx):
    """(max of x, the first index where x reaches it): x, idx (R, BLOCK)."""
    m = tl.max(tl.max(x, 1), 0)
    return m, tl.min(tl.min(tl.where(x == m, idx, 2147483647), 1), 0)


@triton.jit
def _coupled_argmax_kernel(s_ptr, k_ptr, out_ptr, V, stride_s,
                           S_TOKEN: tl.constexpr, S_MIN: tl.constexpr, S_ARG: tl.constexpr,
                           M1: tl.constexpr, M2: tl.constexpr, GOLDEN: tl.constexpr,
                           BLOCK: tl.constexpr, TB: tl.constexpr):
    row = tl.program_id(0)
    s_row = s_ptr + row.to(tl.int64) * stride_s
    key = tl.load(k_ptr + row).to(tl.uint32)  # keys hold 32-bit values
    rb = tl.arange(0, TB)  # (TB,) blocks of a tile
    j = tl.arange(0, BLOCK)  # (BLOCK,) tokens of a block
    num_tiles = tl.cdiv(V, TB * BLOCK)
    # pass 1: the block with the largest bound (first on ties), and NaN detection
    top_bound = tl.full((), float("-inf"), tl.float64)
    top_block = tl.full((), 0, tl.int32)
    nan = tl.full((), 0, tl.int32)
    for tile in range(0, num_tiles):
        s, blocks, minima, bound = _bounds(s_row, key, tile, V, rb, j, S_MIN, M1, M2, GOLDEN, BLOCK, TB)
        nan += tl.sum(tl.sum((s != s).to(tl.int32), 1), 0)
        tb = tl.max(bound, 0)
        tblock = tl.min(tl.where(bound == tb, blocks, 2147483647), 0)
        better = tb > top_bound
        top_block = tl.where(better, tblock, top_block)
        top_bound = tl.where(better, tb, top_bound)
    # that block, exactly: the first best score
    tv = top_block * BLOCK + j  # (BLOCK,)
    ts = tl.load(s_row + tv, mask=tv < V, other=float("-inf")).to(tl.float64)[None, :]  # (1, BLOCK)
    tblk = tl.zeros((1,), dtype=tl.int32) + top_block  # (1,)
    tmin = -tl.log(_uniform(key, S_MIN, tblk.to(tl.uint32), M1, M2, GOLDEN)) / BLOCK  # (1,)
    best, token = _first_max(_noisy(ts, key, tblk, tmin, j, S_TOKEN, S_ARG, M1, M2, GOLDEN, BLOCK),
                             tv[None, :])
    # pass 2: every tile with a block that can reach the best, in order (ties: the first index)
    for tile in range(0, num_tiles):
        s, blocks, minima, bound = _bounds(s_row, key, tile, V, rb, j, S_MIN, M1, M2, GOLDEN, BLOCK, TB)
        if tl.max(bound, 0) >= best:
            x = _noisy(s, key, blocks, minima, j, S_TOKEN, S_ARG, M1, M2, GOLDEN, BLOCK)  # (TB, BLOCK)
            m, arg = _first_max(x, blocks[:, None] * BLOCK + j[None, :])
            better = (m > best) | ((m == best) & (arg < token))
            token = tl.where(better, arg, token)
            best = tl.where(better, m, best)
    tl.store(out_ptr + row, tl.where(nan > 0, -1, token).to(tl.int64))


def coupled_argmax(scores: torch.Tensor, keys: torch.Tensor, *, block: int, streams: tuple[int, int, int],
                   mix: tuple[int, int], golden: int) -> torch.Tensor:
    """scores (N, V) float (-inf = filtered), keys (N,) int64 position keys -> (N,) int64 tokens,
    -1 for a row with a NaN score; one launch, no host sync. `block`, `streams` (token,
    block_min, block_arg), `mix` and `golden` are decoding/noise.py's constants."""
    N, V = scores.shape
    out = torch.empty(N, dtype=torch.long, device=scores.device)
    if N == 0:
        return out
    if V == 0 or V >= 2**31:
        raise ValueError(f"coupled_argmax: vocabulary of {V} tokens")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    _coupled_argmax_kernel[(N,)](
        scores, keys.to(torch.long).contiguous(), out, V, scores.stride(0),
        S_TOKEN=streams[0], S_MIN=streams[1], S_ARG=streams[2], M1=mix[0], M2=mix[1], GOLDEN=golden,
        BLOCK=block, TB=TILE_BLOCKS, num_warps=NUM_WARPS)
    return out
