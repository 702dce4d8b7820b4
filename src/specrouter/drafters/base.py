"""The model-free drafters' contract (`DrafterProtocol`) and the helpers they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specrouter.drafters.trees import TreeProposal


@dataclass(frozen=True)
class Proposal:
    """One row's proposal (`DrafterProtocol.propose_row`)."""

    tokens: np.ndarray  # (m,) int64 proposed tokens
    confidence: np.ndarray  # (m,) float64 cumulative probability of each prefix (decreasing)
    match_len: int  # length of the matched context suffix (0: no match)

    @property
    def score(self) -> float:
        """Expected accepted tokens under the drafter's own frequency model."""
        return float(self.confidence.sum())


EMPTY = Proposal(np.zeros(0, np.int64), np.zeros(0), 0)


class DrafterProtocol(Protocol):
    """A model-free drafter (level M1 without a neural model): proposes up to k tokens per row
    from the row's context (prompt lookup) or from earlier requests (suffix decoding). Its
    proposal distribution is one-hot at the proposed token, so speculative sampling against it
    stays lossless. Everything the engine, the executor and the pool call is declared here."""

    name: str  # its name in a pool
    is_model_free: bool  # True (the cost profile times a proposal, not a forward)
    sized_by_confidence: bool  # propose() honours min_confidence (stops below the router's floor)
    proposes_trees: bool  # propose_trees() offers several continuations (drafters/trees.py)

    def propose(self, contexts: Sequence[Sequence[int]], k: int | Sequence[int],
                tenants: Sequence[str | None] | None = None,
                min_confidence: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (tokens (B, max k) int64 right-padded, lengths (B,) int64 in 0..k); `k` is one
        draft length for all rows or one per row. `tenants` (one per row, None: shared) picks
        whose learned statistics a learning drafter reads; `min_confidence` (one per row) is
        where a confidence-sized drafter stops (others ignore it)."""
        ...

    def propose_row(self, context: np.ndarray, k: int, tenant: str | None = None,
                    min_confidence: float | None = None) -> Proposal:
        """One row's proposal with its confidences and match length (the engine's
        confident-draft check)."""
        ...

    def propose_trees(self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], k: Sequence[int],
                      tenants: Sequence[str | None] | None = None,
                      min_confidence: Sequence[float] | None = None) -> list[TreeProposal]:
        """Per row a token tree of at most `budgets[b]` nodes, `k[b]` deep, best-first
        (drafters/trees.py; its main path is the chain `propose` would give). A drafter whose
        `proposes_trees` is False returns its chain as the tree."""
        ...

    def observe_request(self, tokens: Sequence[int], tenant: str | None = None) -> None:
        """A finished request's tokens (prompt + output): a learning drafter learns them."""
        ...

    def fresh(self) -> "DrafterProtocol":
        """The same drafter with nothing learned (a pool view of its own)."""
        ...


ModelFreeDrafter = DrafterProtocol  # the name used across the package


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
