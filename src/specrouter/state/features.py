"""The target's features per row: what a draft head level reads (models/heads/level.py).

A feature is the target's last decoder layer output at a position, before the final norm
(`LlamaRunner.forward_with_features`). The store is laid out like a KV cache: one row per cache
slot of the TARGET, one entry per position, (num_slots, max_len, H) in the target's dtype, so
its lengths follow the same rules as the cache's:

- the target's `ModelState.features` counts the leading positions of the row the store holds;
  the valid ones are `min(features, cache_len)` (`valid_features`): whatever rolls the
  target's cache back (commit keeping the accepted prefix, a failed cycle restored) rolls its
  features back with it, O(1), without touching the store;
- a target forward that keeps features writes them for every position it feeds; one that does
  not (no head in any chain of the step) leaves positions past its start unwritten, so the
  count stops at that start (`after_forward`); the executor re-feeds such a gap to the target
  when a head next drafts for the row (decoding/head_drafting.py).
"""

from __future__ import annotations

import torch

from specrouter.models.runners.base import ForwardBatch


def valid_features(features: int, cache_len: int) -> int:
    """Leading positions whose features are valid: those counted that the cache still holds."""
    return min(features, cache_len)


def after_forward(features: int, start: int, end: int, kept: bool) -> int:
    """The count after a forward fed positions [start, end): `end` when it kept features and
    the stored ones reached `start` (contiguous), else the valid prefix up to `start`."""
    have = min(features, start)
    return end if kept and have == start else have


class FeatureStore:
    """(num_slots, max_len, H) features by target slot and position; grown with the target's
    cache (`ensure`, only while no row is live, as `reserve`)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device)
        self.buffer = torch.zeros(0, 0, hidden_size, dtype=dtype, device=self.device)

    def ensure(self, num_slots: int, max_len: int) -> None:
        """Hold at least `num_slots` x `max_len` positions (contents are lost when it grows)."""
        S, L, H = self.buffer.shape
        if num_slots > S or max_len > L:
            self.buffer = torch.zeros(max(num_slots, S), max(max_len, L), H, dtype=self.dtype,
                                      device=self.device)

    def write(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """Store `features` (B, T, H) of a target forward at (slots[b], starts[b] + i), for the
        valid new tokens i < num_tokens[b] of every row."""
        B, T, H = features.shape
        L = self.buffer.shape[1]
        ar = torch.arange(T, device=features.device)
        flat = (batch.slots * L + batch.starts)[:, None] + ar  # (B, T) rows of the flat store
        if min(batch.num_tokens_list) == T:  # no padding: every position is written
            self.buffer.view(-1, H).index_copy_(0, flat.view(-1), features.reshape(B * T, H).to(self.dtype))
            return
        valid = (ar < batch.num_tokens[:, None]).view(-1)  # (B*T,)
        self.buffer.view(-1, H).index_copy_(0, flat.view(-1)[valid],
                                            features.reshape(B * T, H)[valid].to(self.dtype))

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """(end - start, H) features of positions [start, end) of a slot (a view)."""
        return self.buffer[slot, start:end]
