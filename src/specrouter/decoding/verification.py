"""One level of multi-level verification, as pure tensor functions (vLLM rejection-sampler style).

Level j of a chain `[M1, ..., MN]` receives up to n candidate tokens per row from the level
below, scores them with ONE forward of `Mj` (n + 1 positions: the distribution of the first
candidate, ..., the distribution after the last one) and returns a `LevelResult`.

Glossary (per row):
- **candidates**: the tokens proposed by the level below (`M1`'s draft at level 2, level j-1's
  output above that); only the first `num_candidates[b]` are valid, the rest are padding.
- **accepted tokens**: the longest prefix of the candidates that this level keeps. Greedy:
  candidate == argmax of the verifier. Sampling: candidate x at position i is accepted with
  probability `min(1, verifier_probs[i, x] / draft_probs[i, x])`; the first rejection stops.
- **recovered token**: after a rejection at position i, the correction sampled from the
  residual `norm(max(0, verifier_probs[i] - draft_probs[i]))` (greedy: the verifier's argmax).
- **bonus token**: when all valid candidates are accepted, one more token from the verifier's
  own distribution at position `num_candidates[b]` (greedy: its argmax).
Every row therefore outputs `num_accepted + 1` tokens (`lengths`): >= 1 per level, so a cycle
commits >= 1 target token.

Why this is lossless, at any temperature / top-k / top-p (all levels share `process_logits`):
the standard speculative-sampling argument is per position. If the token at position i of the
proposal, given everything before it (the tokens AND the random choices that decided that
position i exists), is distributed as `draft_probs[i]`, then the token this level outputs at i
is accepted with probability mass `min(draft_probs, verifier_probs)` and recovered with mass
`(1 - sum min) * residual = max(0, verifier_probs - draft_probs)`, in total `verifier_probs[i]`;
and whether position i + 1 exists depends only on what happened up to i (the length is a
stopping time). So what level j outputs (accepted + recovered/bonus) is, position by position,
a valid sample of `Mj`'s own processed distribution, hence a valid proposal for level j + 1
with `Mj`'s probs (`LevelResult.probs`, NOT the residual) as its proposal distribution. By
induction the target's output is distributed exactly as the target sampling alone. Greedy is
the special case of one-hot distributions: with a one-hot `verifier_probs` the acceptance
probability is 1 or 0 and the residual is the one-hot itself, so `verify_speculative`
reduces exactly to `verify_greedy`; one-hot `draft_probs` (greedy drafts, model-free n-gram
guesses) are valid proposals as they are.

Padding convention: `LevelResult.tokens` is right-padded with `PAD_TOKEN_ID` (-1, an invalid
index on purpose); candidates past `num_candidates[b]` may hold anything (they are ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrouter.decoding.sampling import sample

PAD_TOKEN_ID = -1  # right padding of LevelResult.tokens (never a valid token id)
RESIDUAL_EPS = 1e-12  # residual mass below this (relative to the verifier's) counts as zero


@dataclass
class LevelResult:
    """What one level passes up the chain (or commits, at the target)."""

    tokens: torch.Tensor  # (B, n+1) int64: accepted candidates, then the recovered or bonus token; PAD_TOKEN_ID after
    lengths: torch.Tensor  # (B,) int64: valid tokens per row = num_accepted + 1 (1..n+1)
    num_accepted: torch.Tensor  # (B,) int64: candidates accepted (0..num_candidates[b])
    probs: torch.Tensor | None  # (B, n+1, V): the verifier's processed distribution at each output position, i.e. the proposal distribution for the next level (positions >= lengths are meaningless); None for greedy


def _finish(
    candidates: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor, probs: torch.Tensor | None
) -> LevelResult:
    """Assemble [accepted candidates..., final token, PAD...] per row."""
    B, n = candidates.shape
    positions = torch.arange(n + 1, device=candidates.device)  # (n+1,)
    padded = torch.nn.functional.pad(candidates, (0, 1), value=PAD_TOKEN_ID)  # (B, n+1)
    tokens = torch.where(positions < num_accepted[:, None], padded, PAD_TOKEN_ID)  # (B, n+1)
    tokens.scatter_(1, num_accepted[:, None], final_token.to(torch.long)[:, None])
    return LevelResult(tokens=tokens, lengths=num_accepted + 1, num_accepted=num_accepted, probs=probs)


def _num_accepted(accepted: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """accepted (B, n) bool per position -> length of the accepted prefix among the valid ones."""
    n = accepted.shape[1]
    valid = torch.arange(n, device=accepted.device) < num_candidates[:, None]  # (B, n)
    return (accepted & valid).long().cumprod(dim=1).sum(dim=1)  # (B,)


def verify_tokens(candidates: torch.Tensor, num_candidates: torch.Tensor, verifier_tokens: torch.Tensor) -> LevelResult:
    """Verification against the tokens the verifier itself samples at every position: greedy
    (argmax) or counter-based sampling (`sampling.choose_tokens`, the same noise at every level).
    candidates (B, n) int64, num_candidates (B,) in 0..n, verifier_tokens (B, n+1) int64
    (position i: the verifier's token where candidate i stands; n: after the last). Accept while
    candidate == verifier token; then the verifier's own token (recovered on a mismatch, bonus
    when all were accepted). Lossless because what a level outputs is exactly what it samples
    alone: the target's output is the target's own sampled sequence, whatever the drafts."""
    B, n = candidates.shape
    assert verifier_tokens.shape == (B, n + 1), f"verifier_tokens {tuple(verifier_tokens.shape)} for {B}x{n} candidates"
    num_accepted = _num_accepted(candidates == verifier_tokens[:, :n], num_candidates)  # (B,)
    final_token = verifier_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    return _finish(candidates, num_accepted, final_token, None)


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
