"""The distillation loss: a fused vocabulary projection + sparse (k+1)-bin KL to the target's
cached top-k distribution, with optional cross-entropy on the target's argmax and a sampled
vocabulary (see distill.py for how it is used)."""

from __future__ import annotations

import math

import torch


class _SparseKL(torch.autograd.Function):
    """Fused vocabulary projection + (k+1)-bin KL (+ optional CE); gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, logp, targets, ce_weight: float, chunk: int, bias):
        # hidden (N, d), weight (V, d), ids/logp (N, k) teacher top-k, targets (N,) next tokens,
        # bias (V,) or None: added to the logits (log importance weights of a sampled vocabulary)
        hb, wb = hidden.detach().to(torch.bfloat16), weight.detach().to(torch.bfloat16)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32)
        p = logp.float().exp()  # (N, k)
        p_tail = (1.0 - p.sum(-1)).clamp(min=0.0)  # (N,) teacher mass outside its top k
        total = torch.zeros((), dtype=torch.float64)
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = (hb[sl] @ wb.T).float()  # (c, V) student logits
            if bias is not None:
                z += bias
            lse = torch.logsumexp(z, -1, keepdim=True)  # (c, 1)
            q = (z - lse).exp_()  # (c, V) student probs
            logq_k = z.gather(1, ids[sl]) - lse  # (c, k)
            q_k = logq_k.exp()
            q_tail = (1.0 - q_k.sum(-1)).clamp(min=1e-12)  # (c,)
            pc, pt = p[sl], p_tail[sl]
            kl = (pc * (logp[sl].float() - logq_k)).sum() + (
                pt * (pt.clamp(min=1e-12).log() - q_tail.log())).sum()
            # dKL/dz: q - p on the top k, q * (1 - p_tail / q_tail) outside it
            g = q * (1.0 - pt / q_tail)[:, None]
            g.scatter_(1, ids[sl], q_k - pc)
            if ce_weight > 0:
                logq_y = z.gather(1, targets[sl, None])[:, 0] - lse[:, 0]
                total -= ce_weight * logq_y.sum()
                g.mul_(1.0 - ce_weight).add_(q, alpha=ce_weight)
                g.scatter_add_(1, targets[sl, None], torch.full_like(logq_y, -ce_weight)[:, None])
                kl = kl * (1.0 - ce_weight)
            total += kl
            gb = g.to(torch.bfloat16)
            grad_h[sl] = (gb @ wb).float()
            grad_w += (gb.T @ hb[sl]).float()
        ctx.save_for_backward(grad_h, grad_w)
        return total.float()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None, None, None, None


def sparse_kl_loss(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor,
    targets: torch.Tensor | None = None, ce_weight: float = 0.0, chunk: int = 128,
    vocab_sample: int = 0, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Summed (1 - ce_weight) * KL(teacher || student) + ce_weight * CE over N positions.

    hidden (N, d): the student's final (normed) hidden states; weight (V, d): its output
    embedding; ids / logp (N, k): the teacher's top-k token ids and log-probabilities (full-
    vocabulary normalised); targets (N,): the CE labels (default: the teacher's argmax).
    The KL is between the (k+1)-bin distributions {top-k tokens, everything else}.
    Logits are computed in bfloat16 and never stored; gradients flow to hidden and weight.

    vocab_sample > 0 makes it a sampled softmax: the logits are computed only over the tokens
    in some top-k (or a target) plus `vocab_sample` tokens drawn uniformly from the rest,
    whose exp-logits count for all the rest (weight (V - |used|) / vocab_sample) in the
    normaliser. Several times cheaper for a 49k vocabulary; every token is still pushed down
    now and then, so no rarely seen token creeps up to the argmax.
    """
    ids, targets = ids.long(), (ids[:, 0] if targets is None else targets).long()
    V = weight.shape[0]
    used = torch.unique(torch.cat([ids.reshape(-1), targets]))  # sorted
    if vocab_sample <= 0 or len(used) + vocab_sample >= V:
        return _SparseKL.apply(hidden, weight, ids, logp, targets, ce_weight, chunk, None)
    free = torch.ones(V, dtype=torch.bool)
    free[used] = False
    rest = free.nonzero()[:, 0]  # (V - |used|,)
    drawn = rest[torch.randperm(len(rest), generator=generator)[:vocab_sample]]
    vocab = torch.cat([used, drawn])  # (S,)
    where = torch.empty(V, dtype=torch.long)
    where[vocab] = torch.arange(len(vocab))
    bias = torch.zeros(len(vocab))
    bias[len(used):] = math.log(len(rest) / vocab_sample)
    return _SparseKL.apply(hidden, weight[vocab], where[ids], logp, where[targets], ce_weight,
                           chunk, bias)
