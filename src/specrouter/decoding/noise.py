"""Counter-based randomness for sampling: every random number a row uses is a pure function of
(its seed, the position it samples), never drawn from a stream consumed in path-dependent order.

Why: the router changes a row's chain and draft length every cycle (from timings), and rows
join and leave batches. With a stream (`torch.Generator`) the draws a row consumes depend on
that path, so a seeded request gave a different text at every run. With counter-based noise the
token a row samples at position i is

    token_i = argmax_v ( scaled_logits_i[v] - log E_v(seed, i) ),   E_v iid Exponential(1)

(the exponential race, i.e. Gumbel-max: -log E is a standard Gumbel). That is an exact sample
of softmax(scaled_logits_i) (temperature / top-k / top-p applied: filtered tokens are -inf),
and it depends on nothing but the distribution and (seed, i). Consequences:
- **path independence**: the target's token at position i is the same whatever chain, k or
  batch produced the prefix: the output of a seeded request equals plain decoding of the target
  with the same seed, at every concurrency, router on or off;
- **coupled drafts**: every level (drafter, verifiers, target) uses the same noise at position
  i, so a draft proposes argmax(its scores - log E) and a verifier accepts a candidate iff it
  equals its own noisy argmax there (`verification.verify_tokens`): sampling verification is
  greedy verification on noisy scores. Acceptance is P(two noisy argmaxes agree), which is at
  least (1 - D_TV) / (1 + D_TV) and at most 1 - D_TV (the acceptance of standard rejection
  sampling, kept as the reference in tests/reference_verification.py);
- **batchable**: randomness is per row by construction; rows with different seeds share one
  forward and one vectorized noise computation.

Noise generation is lazy and exact. The vocabulary (padded with -inf to whole blocks of
`BLOCK` tokens) is cut into blocks; per (seed, position, block) the hash gives the block's
minimum M_B ~ Exp(BLOCK) (the minimum of BLOCK iid Exp(1)) and its argmin (uniform in the
block); the other tokens of the block get M_B + Exp(1) (memorylessness: given the minimum, the
others exceed it by iid Exp(1)). So E_v is a fixed function of (seed, position, v), iid Exp(1)
over v, and every token of block B has -log E_v <= -log M_B: the block's best score is at most
max(scores in B) - log M_B. `coupled_argmax` evaluates blocks in decreasing order of that bound
and stops when the best score found beats the next block's bound: usually one or two blocks of
`BLOCK` (64) tokens instead of the 49k of a full vocabulary. `exponential_noise` materializes
all E_v: the plain reference the lazy path is tested against.

The hash: 32-bit integer mixing ("lowbias32", Wellons) on int64 tensors, masked to 32 bits; a
uniform is (x + 0.5) / 2^32, never 0 or 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK = 64  # tokens per noise block
_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_GOLDEN = 0x9E3779B1
_STREAM = {"token": 0x3C6EF372, "block_min": 0x5851F42D, "block_arg": 0x14057B7E}


def _mix32_int(x: int) -> int:
    x &= _MASK
    x ^= x >> 16
    x = (x * _M1) & _MASK
    x ^= x >> 15
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap: the low 32 bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 32-bit key of a request's seed (any Python int: taken modulo 2^64)."""
    s = seed % (1 << 64)
    return _mix32_int(_mix32_int((s & _MASK) ^ 0x243F6A88) ^ (s >> 32))


def position_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(...) int64 keys of (seed, position): seed_keys and positions broadcast (int64)."""
    return _mix32(seed_keys ^ _mix32((positions * _GOLDEN + 0x85EBCA6B) & _MASK))


def position_key(seed_key: int, position: int) -> int:
    """`position_keys` of one (seed key, position), in Python ints (the same integer math: a
    few rows' keys without ~10 tensor ops)."""
    return _mix32_int(seed_key ^ _mix32_int((position * _GOLDEN + 0x85EBCA6B) & _MASK))


def _uniform(keys: torch.Tensor, stream: str, counters: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1): keys and counters broadcast (int64)."""
    return _uniform_streams(keys ^ _STREAM[stream], keys, counters)


def _block_min(keys: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """M_B: keys (N, 1), blocks (N, r) or (1, r) -> (N, r) float64, Exp(BLOCK) minima."""
    return -torch.log(_uniform(keys, "block_min", blocks)) / BLOCK


def _block_noise(keys: torch.Tensor, blocks: torch.Tensor, minima: torch.Tensor) -> torch.Tensor:
    """E_v of every token of the given blocks: keys (N, 1), blocks (N, r), minima (N, r) ->
    (N, r, BLOCK) float64."""
    j = torch.arange(BLOCK, dtype=torch.long, device=keys.device)  # (BLOCK,)
    tokens = blocks[..., None] * BLOCK + j  # (N, r, BLOCK)
    extra = -torch.log(_uniform(keys[..., None], "token", tokens))  # (N, r, BLOCK)
    arg = (_uniform(keys, "block_arg", blocks) * BLOCK).long().clamp_(max=BLOCK - 1)  # (N, r)
    extra = torch.where(j == arg[..., None], 0.0, extra)
    return minima[..., None] + extra


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Reference: every E_v, (N, vocab) float64, for keys (N,) int64 (position keys)."""
    nb = -(-vocab // BLOCK)
    blocks = torch.arange(nb, dtype=torch.long, device=keys.device)[None, :]  # (1, nb)
    k = keys[:, None]
    noise = _block_noise(k, blocks.expand(len(keys), nb), _block_min(k, blocks))  # (N, nb, BLOCK)
    return noise.reshape(len(keys), nb * BLOCK)[:, :vocab]


def token_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """E_v of the given tokens only: keys (N,) int64 position keys, tokens (N, M) int64 ->
    (N, M) float64, equal to `exponential_noise(keys, V).gather(1, tokens)` (a tree drafter
    ranks a few candidates by their noisy scores, decoding/tree_drafting.py)."""
    k = keys[:, None]  # (N, 1)
    blocks = tokens // BLOCK  # (N, M)
    # the three streams' uniforms (integer hashing: the same bits as three `_uniform` calls):
    # token, block_arg, block_min; natively (kernels/noise.cpp `token_uniforms`) where built,
    # else in one pass of the torch hash (a third of the small tensor ops)
    ops = _native() if keys.device.type == "cpu" else None
    if ops is not None:
        u = ops.token_uniforms(keys, tokens)  # (3, N, M)
    else:
        streams = torch.tensor([_STREAM["token"], _STREAM["block_arg"], _STREAM["block_min"]],
                               dtype=torch.long, device=keys.device)[:, None, None]  # (3, 1, 1)
        u = _uniform_streams(k ^ streams, k, torch.stack([tokens, blocks, blocks]))  # (3, N, M)
    extra = -torch.log(u[0])  # (N, M)
    arg = (u[1] * BLOCK).long().clamp_(max=BLOCK - 1)  # (N, M)
    extra = torch.where(tokens % BLOCK == arg, 0.0, extra)
    return -torch.log(u[2]) / BLOCK + extra  # _block_min + extra


def _uniform_streams(keyed: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`_uniform(keys, stream, counters)` with keys ^ stream given (`keyed`): keyed, keys and
    counters broadcast (int64)."""
    x = _mix32(keyed)
    x = _mix32((x + counters * _GOLDEN) & _MASK)
    x = _mix32(x ^ keys)
    return (x.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def coupled_argmax_reference(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Reference: argmax_v scores[n, v] - log E_v(keys[n]), materializing all the noise."""
    noise = exponential_noise(keys, scores.shape[-1])
    return (scores.to(torch.float64) - noise.log()).argmax(-1)


def coupled_argmax(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """scores (N, V) float (scaled logits; -inf = filtered), keys (N,) int64 position keys ->
    (N,) int64 tokens: argmax_v scores - log E_v, equal to `coupled_argmax_reference` (module
    docstring: lazy block evaluation with an exact stopping bound). One native call where the
    native kernels are built (kernels/noise.cpp); on CUDA one Triton launch with no host sync
    (models/runners/triton/noise.py), where a row with NaN scores gets -1 instead of raising:
    `check_tokens` raises where the tokens reach the host; else `coupled_argmax_torch`."""
    if _use_triton(scores):
        return coupled_argmax_triton(scores, keys)
    ops = _native()
    if ops is not None and scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return ops.coupled_argmax(scores, keys.to(torch.long))
    return coupled_argmax_torch(scores, keys)


def _use_triton(scores: torch.Tensor) -> bool:
    """The Triton kernel for CUDA tensors (tests route CPU tensors to it under the interpreter)."""
    from specrouter.models.runners.triton import triton_available

    return scores.device.type == "cuda" and triton_available()


def coupled_argmax_triton(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`coupled_argmax` in one Triton launch, no host sync (CUDA; CPU tensors under
    TRITON_INTERPRET=1): (N,) int64 tokens, -1 for a row with a NaN score."""
    from specrouter.models.runners.triton import noise as kernel

    return kernel.coupled_argmax(scores, keys, block=BLOCK, mix=(_M1, _M2), golden=_GOLDEN,
                                 streams=(_STREAM["token"], _STREAM["block_min"], _STREAM["block_arg"]))


def check_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Host tokens from `coupled_argmax`, raised on where a row had NaN scores (-1: the GPU path
    marks them instead of syncing to raise); returns `tokens`."""
    if bool((tokens < 0).any()):
        raise RuntimeError("invalid distribution: NaN scores (non-finite logits or temperature)")
    return tokens


def _native():
    from specrouter.models.runners.kernels import rowinv

    return rowinv()


def native_ops():
    """The native kernels' ops (`coupled_argmax`, `choose_tokens`: kernels/noise.cpp) where they
    are built, else None."""
    return _native()


def coupled_argmax_torch(scores: torch.Tensor, keys: torch.Tensor, first_blocks: int = 8) -> torch.Tensor:
    """`coupled_argmax` in torch ops (the portable path; ~100 small ops per call)."""
    N, V = scores.shape
    if N == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    nb = -(-V // BLOCK)
    s = scores if nb * BLOCK == V else F.pad(scores, (0, nb * BLOCK - V), value=-math.inf)
    s = s.view(N, nb, BLOCK)
    k = keys[:, None]  # (N, 1)
    minima = _block_min(k, torch.arange(nb, dtype=torch.long, device=s.device)[None, :])  # (N, nb) float64
    bound = s.amax(-1).to(torch.float64) - minima.log()  # (N, nb): no token of block B scores above it
    if bool(torch.isnan(bound).any()):  # what torch.multinomial refuses too
        raise RuntimeError("invalid distribution: NaN scores (non-finite logits or temperature)")
    r = min(first_blocks, nb)
    top = bound.topk(min(r + 1, nb), dim=-1)  # the r most promising blocks and the next bound
    idx = top.indices[:, :r]  # (N, r)
    noise = _block_noise(k, idx, minima.gather(1, idx))  # (N, r, BLOCK)
    cand = s[torch.arange(N, device=s.device)[:, None], idx].to(torch.float64) - noise.log()  # (N, r, BLOCK)
    best, arg = cand.view(N, r * BLOCK).max(-1)  # (N,)
    tokens = idx.gather(1, (arg // BLOCK)[:, None]).squeeze(1) * BLOCK + arg % BLOCK  # (N,)
    if r < nb:  # rows whose best does not beat the next block's bound look further
        todo = torch.nonzero(best <= top.values[:, r]).flatten()
        if len(todo):
            tokens[todo] = coupled_argmax_torch(scores[todo], keys[todo], first_blocks=4 * r)
    return tokens
