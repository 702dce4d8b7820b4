"""Log-probabilities of tokens, read from logits a forward computed anyway. Pure tensor functions.

Which distribution (vLLM's `logprobs_mode="processed_logprobs"`; written down because vLLM's
default is the raw one):
- a generated token's logprob, and its top alternatives, are under the distribution the target
  sampled it from: the logits after the request's logits processors (processors.py: grammar,
  allowed_token_ids, logit_bias, min_tokens, penalties), then, for a sampling row, temperature,
  min_p, top-k and top-p (sampling.scaled_logits; filtered tokens have logprob -inf). A greedy
  row's distribution is the softmax of its processed logits (no temperature): the token is its
  argmax, and with no processors the logprobs are the model's own.
- a prompt token's logprob is under the target's raw distribution (softmax of its logits, no
  processor or temperature: nothing was sampled there), vLLM's prompt_logprobs and what
  OpenAI's `echo` + `logprobs` score.

Where the logits come from: a generated token's from the target's verification forward of the
cycle that committed it (the same logits plain decoding computes at that position: the runners
are row-invariant), so logprobs cost no forward; a prompt's from the target's prefill of it
(executor: a row asking for prompt logprobs prefills its prompt in a forward of its own that
returns every position's logits, instead of reading it from the prefix cache).

A token whose logprob is -inf (filtered) keeps -inf here; the server writes it as -9999.0 (JSON
has no infinity; vLLM does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrouter.decoding.sampling import SamplingTensors, scaled_logits


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely alternatives at its position."""

    token: int  # the token (committed, or the prompt's)
    logprob: float  # its log-probability
    rank: int  # 1 + how many tokens are strictly more likely (1: the argmax)
    top: tuple[tuple[int, float], ...]  # (token, logprob) of the n most likely, most likely first


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x (..., V) -> log-probabilities (..., V), float32 (float64 for float64 input); -inf stays
    -inf (a row with every token -inf is NaN: the caller never has one)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.log_softmax(x.to(dtype), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_top: list[int]) -> list[list[TokenLogprob]]:
    """logprobs (R, G, V) log-probabilities, tokens (R, G) int64 (positions g >= lengths are
    padding the caller drops), num_top[r]: alternatives row r wants -> per row, per position,
    its TokenLogprob (one host transfer for the whole batch)."""
    R, G, V = logprobs.shape
    chosen = logprobs.gather(-1, tokens[..., None])  # (R, G, 1)
    rank = (logprobs > chosen).sum(-1) + 1  # (R, G)
    K = min(max(num_top, default=0), V)
    if K:
        top_vals, top_ids = logprobs.topk(K, dim=-1)  # (R, G, K), most likely first
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen, rank, toks = chosen[..., 0].tolist(), rank.tolist(), tokens.tolist()
    out = []
    for r in range(R):
        n = min(num_top[r], V)
        out.append([TokenLogprob(toks[r][g], chosen[r][g], rank[r][g],
                                 tuple(zip(top_ids[r][g][:n], top_vals[r][g][:n])) if n else ())
                    for g in range(G)])
    return out


def generated_logprobs(processed: torch.Tensor, st: SamplingTensors, tokens: torch.Tensor,
                       num_top: list[int]) -> list[list[TokenLogprob]]:
    """Generated tokens' logprobs under the distribution each was sampled from: processed
    (R, G, V) logits after the rows' logits processors (processors.process_rows), st the rows'
    sampling parameters, tokens (R, G) the tokens at those positions."""
    return gather_logprobs(log_softmax(scaled_logits(processed, st)), tokens, num_top)


def prompt_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """Prompt tokens' logprobs under the raw distribution: raw (P, V) logits at prompt positions
    0..P-1, tokens (P,) the prompt tokens 1..P they predict."""
    return gather_logprobs(log_softmax(raw)[None], tokens[None], [num_top])[0]
