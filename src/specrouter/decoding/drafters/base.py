"""Interface of model-free drafters (level M1 without a neural model)."""

from __future__ import annotations

from typing import Protocol

import torch


class ModelFreeDrafter(Protocol):
    """Proposes up to k tokens per row from the row's own context (e.g. prompt lookup).
    Its proposal distribution is one-hot at the proposed token, so speculative sampling
    against it stays lossless."""

    name: str

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (tokens (B, k) int64 right-padded, lengths (B,) int64 in 0..k)."""
        ...
