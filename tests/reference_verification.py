"""REFERENCE, not the production path: classic speculative sampling (Leviathan et al. 2023;
Chen et al. 2023), one level as pure tensor functions. Production verifies with
`specrouter.decoding.verification.verify_tokens` against each level's own coupled sample
(`sampling.choose_tokens`). These functions were in the package and unused; they stay here as
the labelled reference the exact-enumeration tests (test_verification_distribution.py) prove
lossless, and as what `verify_tokens` is compared with on one-hot (greedy) rows.

Candidate x at position i is accepted with probability `min(1, verifier_probs[i, x] /
draft_probs[i, x])`; the first rejection stops; the recovered token is sampled from the
residual `norm(max(0, verifier_probs[i] - draft_probs[i]))`, the bonus token from the verifier.
Per position, the output is distributed as `verifier_probs`, hence a valid proposal for the next
level with the verifier's probs (`LevelResult.probs`) as its proposal distribution.
"""

from __future__ import annotations

import torch

from specrouter.decoding.sampling import sample
from specrouter.decoding.verification import LevelResult, _finish, _num_accepted, verify_tokens

RESIDUAL_EPS = 1e-12  # residual mass below this (relative to the verifier's) counts as zero


def verify_greedy(candidates: torch.Tensor, num_candidates: torch.Tensor, verifier_logits: torch.Tensor) -> LevelResult:
    """Greedy verification. candidates (B, n) int64, num_candidates (B,) int64 in 0..n,
    verifier_logits (B, n+1, V): position i scores candidate i (position n: after the last).
    Accept while candidate == argmax; the next token is the argmax after the accepted prefix
    (recovered on a mismatch, bonus when all num_candidates[b] were accepted)."""
    B, n = candidates.shape
    assert verifier_logits.shape[:2] == (B, n + 1), f"verifier_logits {tuple(verifier_logits.shape)} for {B}x{n} candidates"
    return verify_tokens(candidates, num_candidates, verifier_logits.argmax(dim=-1))


def acceptance_probability(draft_probs: torch.Tensor, verifier_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """draft_probs, verifier_probs (..., V), tokens (...) int64 in [0, V) ->
    min(1, verifier_probs[x] / draft_probs[x]) (...) at x = tokens. A token the draft gave
    probability 0 (an inconsistent proposal) is accepted iff the verifier gives it mass."""
    dtype = torch.promote_types(draft_probs.dtype, verifier_probs.dtype)
    idx = tokens[..., None]
    d = draft_probs.gather(-1, idx).squeeze(-1).to(dtype)  # (...)
    v = verifier_probs.gather(-1, idx).squeeze(-1).to(dtype)  # (...)
    ratio = (v / d.clamp_min(torch.finfo(d.dtype).tiny)).clamp(max=1.0)
    return torch.where(d > 0, ratio, (v > 0).to(v.dtype))


def residual_distribution(draft_probs: torch.Tensor, verifier_probs: torch.Tensor) -> torch.Tensor:
    """draft_probs, verifier_probs (..., V) -> norm(max(0, verifier_probs - draft_probs)) (..., V),
    the distribution of the recovered token. Where the residual mass is ~0 (< RESIDUAL_EPS times
    the verifier's mass: a rejection there has probability ~0), returns verifier_probs."""
    dtype = torch.promote_types(draft_probs.dtype, verifier_probs.dtype)
    v = verifier_probs.to(dtype)
    residual = (v - draft_probs.to(dtype)).clamp_min(0.0)  # (..., V)
    mass = residual.sum(dim=-1, keepdim=True)  # (..., 1)
    ok = mass > RESIDUAL_EPS * v.sum(dim=-1, keepdim=True)
    return torch.where(ok, residual / torch.where(ok, mass, 1.0), v)


def verify_speculative(
    candidates: torch.Tensor,
    num_candidates: torch.Tensor,
    draft_probs: torch.Tensor,
    verifier_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> LevelResult:
    """Speculative-sampling verification, vectorized over the batch.

    candidates (B, n) int64; num_candidates (B,) int64 in 0..n; draft_probs (B, n, V): the
    proposal distribution each candidate was drawn from; verifier_probs (B, n+1, V): this
    level's processed distributions (position i for candidate i, position n after the last).
    Random draws, in this order from `generator`: B*n uniforms (all positions at once), then one
    multinomial draw per row for the recovered/bonus token. Returns probs = verifier_probs."""
    B, n = candidates.shape
    V = verifier_probs.shape[-1]
    assert draft_probs.shape == (B, n, V), f"draft_probs {tuple(draft_probs.shape)}, expected {(B, n, V)}"
    assert verifier_probs.shape == (B, n + 1, V), f"verifier_probs {tuple(verifier_probs.shape)}, expected {(B, n + 1, V)}"
    device = verifier_probs.device
    # 1. accept/reject every position at once; keep the prefix before the first rejection
    accept_prob = acceptance_probability(draft_probs, verifier_probs[:, :n], candidates.clamp(0, V - 1))  # (B, n)
    uniforms = torch.rand((B, n), generator=generator, device=device, dtype=accept_prob.dtype)  # (B, n)
    num_accepted = _num_accepted(uniforms < accept_prob, num_candidates)  # (B,)
    # 2. the distribution of the token after the accepted prefix: residual or bonus
    rows = torch.arange(B, device=device)
    final_verifier = verifier_probs[rows, num_accepted]  # (B, V)
    if n > 0:
        final_draft = draft_probs[rows, num_accepted.clamp(max=n - 1)]  # (B, V); unused by bonus rows
        is_bonus = (num_accepted >= num_candidates)[:, None]  # (B, 1)
        final_dist = torch.where(is_bonus, final_verifier, residual_distribution(final_draft, final_verifier))
    else:
        final_dist = final_verifier
    # 3. sample it and assemble the output
    final_token = sample(final_dist, generator)  # (B,)
    return _finish(candidates, num_accepted, final_token, verifier_probs)
