"""The head's loss at one draft depth: EAGLE's feature regression (smooth L1 between the normed
predicted and true features) plus the token loss on the reduced vocabulary, a mix of the
target's cached top-k distribution (soft cross-entropy over the part of its top k inside the
vocabulary, renormalised) and cross-entropy on the target's greedy token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossParts:
    """One depth's loss and what it is made of (all means over the positions scored)."""

    total: torch.Tensor  # feature_weight * feature + token_weight * token (differentiable)
    feature: float  # smooth L1 of the normed features
    token: float  # (1 - ce_weight) * soft CE + ce_weight * CE
    hits: int  # positions where the head's argmax is the target's greedy token
    positions: int


def depth_loss(pred_normed: torch.Tensor, true_normed: torch.Tensor, logits: torch.Tensor,
               topk_index: torch.Tensor, topk_logp: torch.Tensor, label_index: torch.Tensor, *,
               feature_weight: float, token_weight: float, ce_weight: float) -> LossParts:
    """pred_normed, true_normed (N, H): the final norm of the predicted and true next features;
    logits (N, V') over the reduced vocabulary; topk_index (N, k): the target's top-k ids as
    reduced-vocabulary indices (-1 outside it), topk_logp (N, k) their log-probabilities;
    label_index (N,): the target's greedy token as a reduced index (-1 outside it)."""
    N = logits.shape[0]
    feature = F.smooth_l1_loss(pred_normed, true_normed)
    logq = torch.log_softmax(logits.float(), -1)  # (N, V')
    p = topk_logp.float().exp() * (topk_index >= 0)  # (N, k): the teacher's mass inside V'
    soft = -(p * logq.gather(1, topk_index.clamp(min=0))).sum(1) / p.sum(1).clamp(min=1e-6)  # (N,)
    inside = label_index >= 0
    ce = -logq.gather(1, label_index.clamp(min=0)[:, None])[:, 0]  # (N,)
    ce = (ce * inside).sum() / inside.sum().clamp(min=1)
    token = (1 - ce_weight) * soft.mean() + ce_weight * ce
    hits = int(((logq.argmax(-1) == label_index) & inside).sum())
    return LossParts(total=feature_weight * feature + token_weight * token, feature=float(feature.detach()),
                     token=float(token.detach()), hits=hits, positions=N)
