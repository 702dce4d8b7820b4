"""The Llama decoder stack on the batch-invariant Triton kernels (the runner's GPU path).

Driven by tensors only: positions, slots and lengths are read on the device, no host value
shapes the computation beyond (B, T), so a forward can be captured once per (B, T) bucket and
replayed as a CUDA graph (`graphs.py`). Every row runs every op whatever its neighbours (padding
tokens write the scratch row `max_len` of their slot and are dropped), so a row's logits are
bitwise the same alone or in a batch, for 1 or k+1 new tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrouter.models.runners.rope import apply_rope
from specrouter.models.runners.triton.attention import attention
from specrouter.models.runners.triton.rmsnorm import rms_norm


def make_norm(eps: float):
    """The runner's `norm(x, weight)` on the Triton RMSNorm (weights as in the checkpoint)."""

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    return norm


def hidden(runner, batch, inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """`LlamaRunner._hidden` on the GPU path: x (B*T, H) after the last layer (before the final
    norm), its input the token embeddings or `inputs` (B*T, H)."""
    from specrouter.models.runners.linear import linear, linear_add

    a = runner.arch
    B, T = batch.tokens.shape
    nh, nkv, D, H, inter = a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.intermediate_size
    ar = runner._arange[:T]  # (T,)
    valid = ar[None, :] < batch.num_tokens[:, None]  # (B, T)
    pos = torch.where(valid, batch.starts[:, None] + ar, runner.max_len)  # (B, T): padding -> scratch row
    cos, sin = runner._cos[pos].unsqueeze(2), runner._sin[pos].unsqueeze(2)  # (B, T, 1, D)
    slot_idx = batch.slots[:, None].expand(B, T)  # (B, T)
    norm = runner._norm
    x = runner._embed_fn(batch.tokens).view(B * T, H) if inputs is None else inputs  # (N, H)
    for (ln1, w_qkv, w_o, ln2, w_gu, w_down), kc, vc, kw, vw in zip(
        runner._layers, runner._k, runner._v, runner._kw, runner._vw
    ):
        qkv = linear(norm(x, ln1), w_qkv).view(B, T, nh + 2 * nkv, D)
        qk = apply_rope(qkv[:, :, : nh + nkv], cos, sin)  # (B, T, nh + nkv, D)
        kw.index_put_((slot_idx, pos), qk[:, :, nh:])  # (B, T, nkv, D) into (S, P, KV, D) views
        vw.index_put_((slot_idx, pos), qkv[:, :, nh + nkv :])
        o = attention(qk[:, :, :nh], kc, vc, batch.slots, batch.starts, batch.num_tokens)  # (B, T, nh, D)
        x = linear_add(x, o.view(B * T, nh * D), w_o)  # residual fused, one rounding
        gu = linear(norm(x, ln2), w_gu)  # (N, 2I)
        x = linear_add(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down)
    return x, None
