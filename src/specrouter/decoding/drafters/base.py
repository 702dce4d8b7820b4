"""Interface of model-free drafters (level M1 without a neural model)."""

from __future__ import annotations

from typing import Protocol

import torch


class ModelFreeDrafter(Protocol):
    """Proposes up to k tokens per row from the row's own context (e.g. prompt lookup).
    Its proposal distribution is one-hot at the proposed token, so speculative sampling
    against it stays lossless."""

    name: str

    def propose(self, contexts: list[list[int]], k: int,
                tenants: list[str | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (tokens (B, k) int64 right-padded, lengths (B,) int64 in 0..k). `tenants`
        (one per row, None: shared) picks whose learned statistics a learning drafter reads."""
        ...


class LearningDrafter(ModelFreeDrafter, Protocol):
    """A model-free drafter that also learns from finished requests (the suffix drafter); the
    engine calls `observe_request` with each finished request's tokens (prompt + output)."""

    def observe_request(self, tokens: list[int], tenant: str | None = None) -> None: ...

    def fresh(self) -> "LearningDrafter":
        """The same drafter with nothing learned."""
        ...
