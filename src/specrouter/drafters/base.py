"""Interface of model-free drafters (level M1 without a neural model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
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


def draft_lengths(k, batch: int) -> list[int]:
    """Per-row draft lengths from `k` (one for all `batch` rows or one per row), checked."""
    ks = [int(k)] * batch if isinstance(k, (int, np.integer)) else [int(x) for x in k]
    if len(ks) != batch:
        raise ValueError(f"propose: {len(ks)} draft lengths for {batch} contexts")
    if any(x < 0 for x in ks):
        raise ValueError(f"propose: draft lengths must be >= 0, got {ks}")
    return ks


def as_int64(ctx) -> np.ndarray:
    """A context (list, numpy array or tensor) as a 1-D int64 array; int64 arrays without a copy."""
    if isinstance(ctx, torch.Tensor):
        ctx = ctx.detach().cpu().numpy()
    arr = np.asarray(ctx, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"propose: each context must be 1-D, got shape {arr.shape}")
    return arr


def pad_drafts(rows: Sequence[np.ndarray], width: int, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Rows of at most `width` values right-padded with 0: (padded (B, width), lengths (B,) int64)."""
    out = np.zeros((len(rows), width), dtype=dtype)  # (B, width)
    lengths = np.zeros(len(rows), dtype=np.int64)  # (B,)
    for b, row in enumerate(rows):
        m = row.shape[0]
        out[b, :m] = row
        lengths[b] = m
    return out, lengths
