"""One level of multi-level verification, as pure tensor functions: `verify_tokens`.

Level j of a chain `[M1, ..., MN]` receives up to n candidate tokens per row from the level
below, scores them with ONE forward of `Mj` (n + 1 positions: the distribution of the first
candidate, ..., the distribution after the last one), picks its OWN token at every position
(`sampling.choose_tokens`: greedy argmax, or a sample with counter-based noise keyed by the
row's seed and the position, the same noise at every level) and returns a `LevelResult`.

Glossary (per row):
- **candidates**: the tokens proposed by the level below (`M1`'s draft at level 2, level j-1's
  output above that); only the first `num_candidates[b]` are valid, the rest are padding.
- **accepted tokens**: the longest prefix of the candidates equal to the verifier's own tokens.
- **recovered token**: after a mismatch at position i, the verifier's own token there.
- **bonus token**: when all valid candidates are accepted, the verifier's own token at position
  `num_candidates[b]`.
Every row therefore outputs `num_accepted + 1` tokens (`lengths`): >= 1 per level, so a cycle
commits >= 1 target token.

Why this is lossless, at any temperature / top-k / top-p: what a level outputs is exactly what
it would sample alone at those positions (its own token wherever it disagrees, and an accepted
candidate IS its own token), so the target commits the target's own sampled sequence whatever
the drafts; the coupling (the same noise at every level) only makes the levels agree often.
Greedy is the special case of argmax tokens. tests/test_verification_distribution.py checks it
by Monte Carlo with negative controls; tests/reference_verification.py keeps classic speculative
sampling (accept with min(1, p/q), recover from the residual) as the labelled reference, with
its exact-enumeration proof; it is not on the production path.

Padding convention: `LevelResult.tokens` is right-padded with `PAD_TOKEN_ID` (-1, an invalid
index on purpose); candidates past `num_candidates[b]` may hold anything (they are ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN_ID = -1  # right padding of LevelResult.tokens (never a valid token id)


@dataclass
class LevelResult:
    """What one level passes up the chain (or commits, at the target)."""

    tokens: torch.Tensor  # (B, n+1) int64: accepted candidates, then the recovered or bonus token; PAD_TOKEN_ID after
    lengths: torch.Tensor  # (B,) int64: valid tokens per row = num_accepted + 1 (1..n+1)
    num_accepted: torch.Tensor  # (B,) int64: candidates accepted (0..num_candidates[b])
    probs: torch.Tensor | None  # (B, n+1, V) proposal distributions for the next level (the reference sampler only); None in production


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
    if n == 0:  # plain steps (no row drafted): the verifier's token is the output (3 small
        # tensor ops instead of 13 on every plain step; the result is the same)
        return LevelResult(tokens=verifier_tokens.to(torch.long), lengths=torch.ones_like(num_candidates),
                           num_accepted=torch.zeros_like(num_candidates), probs=None)
    num_accepted = _num_accepted(candidates == verifier_tokens[:, :n], num_candidates)  # (B,)
    final_token = verifier_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    return _finish(candidates, num_accepted, final_token, None)


def verify_rows(candidates: list[list[int]], verifier_tokens: list[list[int]]) -> list[list[int]]:
    """`verify_tokens` on host lists (the executor's path: a few rows of a few tokens, where
    plain Python beats a dozen small tensor ops): per row, `verifier_tokens[b][: a + 1]` with `a`
    the accepted prefix of `candidates[b]`, i.e. the accepted candidates (equal to the
    verifier's tokens there) then the recovered or bonus token. Row b's verifier tokens hold at
    least len(candidates[b]) + 1 entries (position i: where candidate i stands)."""
    out = []
    for cand, ver in zip(candidates, verifier_tokens):
        a = 0
        for c, v in zip(cand, ver):
            if c != v:
                break
            a += 1
        out.append(ver[: a + 1])
    return out
