"""Total-variation distance between two levels' next-token distributions at the same positions:
the router's similarity signal (docs/design.md, Pillar 1: SimScore = 1 - E[D_TV]).

At a verified position both distributions exist: the verifier's logits from its forward and the
drafter's from the forward that drafted the candidate (a draft model, a draft head, or a lower
verifier passing its output up). `level_tv` compares them for every row of a level at once. Each
row's distributions are its processed ones (`sampling.scaled_logits`: temperature, min-p, top-k,
top-p); a greedy row's processed distribution is a one-hot, which would make D_TV a mismatch
indicator, so greedy rows compare the temperature-1 distributions instead (the router maps each
mode's SimScore to acceptance with its own calibration).
"""

from __future__ import annotations

import math

import torch

from specrouter.decoding.sampling import SamplingTensors, scaled_logits


def candidate_mask(num_candidates: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) bool: position i of row b holds a valid candidate (i < num_candidates[b])."""
    return torch.arange(n, device=num_candidates.device)[None, :] < num_candidates[:, None]


def tv_distance(draft_probs: torch.Tensor, verifier_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) float64: per row, the mean over masked positions of D_TV = 1/2 sum_v |p - q|.

    draft_probs (B, n, V): the proposal distribution at each candidate position; verifier_probs
    (B, >= n, V): the verifier's at the same positions (its extra bonus position is ignored);
    mask (B, n): valid candidates. Rows without any get NaN."""
    n = draft_probs.shape[1]
    if n == 0:
        return torch.full((draft_probs.shape[0],), math.nan, dtype=torch.float64)
    tv = 0.5 * (draft_probs - verifier_probs[:, :n].to(draft_probs.dtype)).abs().sum(-1)  # (B, n)
    m = mask[:, :n].to(torch.float64)
    count = m.sum(1)  # (B,)
    total = (tv.to(torch.float64) * m).sum(1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, math.nan))


def candidate_tv(draft_probs: torch.Tensor, verifier_probs: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """(B,) per-row mean D_TV at a level's valid candidates, from what the executor has at the
    level: draft_probs (B, n, V), verifier_probs (B, n + 1, V), num_candidates (B,). NaN: none."""
    return tv_distance(draft_probs, verifier_probs, candidate_mask(num_candidates, draft_probs.shape[1]))


def tv_from_logits(
    draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """`tv_distance` of softmax(logits / temperature): greedy mode's SimScore (temperature 1)."""
    n = draft_logits.shape[1]
    d = torch.softmax(draft_logits.to(torch.float32) / temperature, dim=-1)  # (B, n, V)
    v = torch.softmax(verifier_logits[:, :n].to(torch.float32) / temperature, dim=-1)  # (B, n, V)
    return tv_distance(d, v, mask)


def level_tv(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, num_candidates: torch.Tensor,
             st: SamplingTensors) -> torch.Tensor:
    """(B,) float64 mean D_TV per row between the drafter's and the verifier's processed
    distributions at the row's candidates (module docstring). draft_logits (B, n, V) at the
    candidate positions (right-padded), verifier_logits (B, >= n, V) from the same positions on,
    num_candidates (B,), st: the rows' sampling parameters. NaN for a row without candidates."""
    n = draft_logits.shape[1]
    d = torch.softmax(scaled_logits(draft_logits.float(), st), dim=-1)  # (B, n, V)
    v = torch.softmax(scaled_logits(verifier_logits[:, :n].float(), st), dim=-1)  # (B, n, V)
    return tv_distance(d, v, candidate_mask(num_candidates.to(d.device), n))
