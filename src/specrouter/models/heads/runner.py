"""A draft head on the native runner's kernels: one draft step over a slot-addressed KV cache.

The head's decoder layer IS a one-layer Llama on the target's architecture, so it runs as a
`LlamaRunner` of one layer (same row-invariant kernels, same RoPE, same cache contract:
rollback = a smaller start), whose first-layer input is the head's fc over
[final_norm(feature), embedding(next token)] instead of the token embedding, and whose logits
are the target's final norm and the reduced vocabulary's LM-head rows (-inf elsewhere, like a
draft's `draft_vocab`).

Engine seam: per row, the engine holds the target's pre-norm feature of the last position the
target has processed (`LlamaRunner.forward_with_features`); a draft cycle is
  1. `step(batch, features)` with tokens = [the token after that position] (the target's bonus or
     recovered token) -> logits for the first draft token, and the predicted feature;
  2. for depth 2..k: `step` with tokens = [the previous draft token] and the predicted feature
     of the step before, at start + 1.
The head's cache positions mirror the target's (position t holds the step that read feature t),
so the state manager rolls it back with the target: after verification, the head's valid
length is the target's committed length minus one, and the catch-up step re-reads the target's
fresh features for the accepted tokens in one multi-token step.
"""

from __future__ import annotations

import torch

from specrouter.models.heads.model import HeadConfig, check_target
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.linear import Linear, linear
from specrouter.models.runners.llama import LlamaRunner


class HeadRunner:
    """The head on `LlamaRunner`'s kernels (native where they run, torch's otherwise)."""

    def __init__(self, config: HeadConfig, params: dict[str, torch.Tensor],
                 target_tensors: dict[str, torch.Tensor], *, name: str = "head",
                 dtype: torch.dtype = torch.float32, num_slots: int = 1, max_len: int | None = None,
                 kernels: str = "native") -> None:
        arch = config.layer_arch
        tensors = {n: t for n, t in params.items() if n.startswith("layers.0.")}
        tensors["embed_tokens.weight"] = target_tensors["embed_tokens.weight"]
        tensors["norm.weight"] = target_tensors["norm.weight"]
        if not arch.tie_word_embeddings:
            tensors["lm_head.weight"] = target_tensors["lm_head.weight"]
        self.config = config
        self.layer = LlamaRunner(arch, tensors, name=name, dtype=dtype, num_slots=num_slots,
                                 max_len=max_len, draft_vocab=list(config.vocab_ids), kernels=kernels)
        self.dtype, self.name = dtype, name
        self.num_params = 2 * arch.hidden_size**2 + sum(
            t.numel() for n, t in tensors.items() if n.startswith("layers.0.")) + len(config.vocab_ids) * arch.hidden_size
        self._embed = tensors["embed_tokens.weight"].to(dtype)  # (V, H)
        self._fc = Linear.pack(params["fc.weight"].to(dtype), None, self.layer._kernel)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward: row b reads `features[b, i]` (pre-norm, the target's or the head's
        own prediction, in the runner's dtype) with `tokens[b, i]` (the token AFTER that
        feature's position), at cache positions starts[b] + i.

        Returns (logits (B, G, V) float32 at batch.logit_positions, -inf outside the head's
        vocabulary; predicted features (B, T, H): of the position after each input's)."""
        B, T = batch.tokens.shape
        H = features.shape[-1]
        normed = self.layer.final_norm(features.reshape(B * T, H))  # (N, H)
        emb = self._embed[batch.tokens.reshape(-1)]  # (N, H)
        x = linear(torch.cat([normed, emb], -1), self._fc)  # (N, 2H) -> (N, H)
        return self.layer.forward_with_features(batch, inputs=x)

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.layer.reserve(num_slots, max_len)


def load_head_runner(path, target, *, dtype: torch.dtype = torch.float32, num_slots: int = 1,
                     max_len: int | None = None, kernels: str = "native") -> HeadRunner:
    """The head saved in `path` (heads/model.save_head) for the target checkpoint `target`."""
    from pathlib import Path

    from specrouter.models.heads.model import read_head
    from specrouter.models.runners.llama import read_checkpoint

    config, params = read_head(path)
    target_config, _arch, tensors = read_checkpoint(target)
    check_target(config, target_config)
    return HeadRunner(config, params, tensors, name=Path(path).resolve().name, dtype=dtype,
                      num_slots=num_slots, max_len=max_len, kernels=kernels)
