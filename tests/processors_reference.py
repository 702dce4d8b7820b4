"""THE REFERENCE (kept for tests): the per-row, per-call logits processors as they were before
issue 31's fast path (decoding/processors.py), unchanged in what they compute. Each call builds
the row's whole history (torch.unique over prompt + generated + path) and penalises its columns
position by position via a cumulative count. decoding/processors.py must equal this bit for
bit (tests/test_processors_fast.py).

Definitions and order: decoding/processors.py's module docstring. The steps issue 31 did not
change (allowed_token_ids / logit_bias, the min_tokens guard) are imported from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrouter.config import SamplingParams
# the allowed_token_ids / logit_bias term and the min_tokens guard: the fast path did not change them
from specrouter.decoding.processors import never_empty, token_mask_and_bias


@dataclass(frozen=True)
class RowHistory:
    """What the processors of one row need at a call: positions g = 0..G-1 of the logits sample
    the tokens at sequence positions `len(tokens) + offset + g`."""

    params: SamplingParams
    tokens: list[int]  # committed tokens: the prompt then the generated ones
    prompt_len: int
    stop_ids: frozenset[int]  # tokens that end generation (masked by min_tokens)
    path: list[int]  # tokens along the draft path after `tokens` (offset + G - 1 of them used)
    offset: int  # positions of the path before logit position 0
    grammar: object | None = None  # the row's RowGrammar (decoding/grammar.py), None: no grammar


def penalize(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
             path_ids: torch.Tensor, offset: int, presence: float, frequency: float,
             repetition: float) -> torch.Tensor:
    """One row's penalties. logits (G, V) float; prompt_ids (P,), output_ids (O,), path_ids (S,)
    int64: position g follows output_ids and path_ids[: offset + g]. Returns (G, V)."""
    G = logits.shape[0]
    P, O = prompt_ids.shape[0], output_ids.shape[0]
    hist = torch.cat([prompt_ids, output_ids, path_ids])  # (P+O+S,)
    if hist.numel() == 0:
        return logits
    uniq, inv = torch.unique(hist, return_inverse=True)  # (U,), (P+O+S,)
    U = uniq.shape[0]
    in_prompt = torch.zeros(U, dtype=torch.bool)
    in_prompt[inv[:P]] = True
    counts = torch.bincount(inv[P : P + O], minlength=U).to(logits.dtype)  # (U,)
    counts = counts.expand(G, U).clone()  # (G, U): generated tokens before each position
    path_cols = inv[P + O :]  # (S,)
    if path_cols.numel():
        first = torch.arange(path_cols.shape[0]) - offset + 1  # path token i counts from g >= i - offset + 1
        keep = first < G
        delta = torch.zeros(G, U, dtype=logits.dtype)
        delta.index_put_((first[keep].clamp(min=0), path_cols[keep]),
                         torch.ones(int(keep.sum()), dtype=logits.dtype), accumulate=True)
        counts += delta.cumsum(dim=0)
    x = logits[:, uniq]  # (G, U)
    if repetition != 1.0:
        seen = in_prompt[None, :] | (counts > 0)  # (G, U)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if frequency:
        x = x - frequency * counts
    if presence:
        x = x - presence * (counts > 0).to(x.dtype)
    out = logits.clone()
    out[:, uniq] = x
    return out


def process_row(logits: torch.Tensor, h: RowHistory) -> torch.Tensor:
    """One row's processors (module docstring order): logits (G, V) -> (G, V)."""
    G, V = logits.shape
    p = h.params
    if h.grammar is not None:
        allowed = h.grammar.allowed(h.tokens[h.prompt_len :], h.path, h.offset, G)  # (G, V)
        logits = logits.masked_fill(~allowed, float("-inf"))
    add = token_mask_and_bias(p, V, logits.dtype)
    if add is not None:
        logits = logits + add[None, :]
    path = h.path[: h.offset + G - 1]
    if p.min_tokens:
        generated = len(h.tokens) - h.prompt_len + h.offset + torch.arange(G)  # (G,) before each position
        early = generated < p.min_tokens  # (G,)
        stops = [t for t in h.stop_ids if t < V]
        if bool(early.any()) and stops:
            masked = logits.clone()
            cols = torch.tensor(stops, dtype=torch.long)
            masked[early.nonzero().flatten()[:, None], cols[None, :]] = float("-inf")
            logits = never_empty(masked, logits)
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        logits = penalize(
            logits, torch.tensor(h.tokens[: h.prompt_len], dtype=torch.long),
            torch.tensor(h.tokens[h.prompt_len :], dtype=torch.long),
            torch.tensor(path, dtype=torch.long), h.offset,
            float(p.presence_penalty), float(p.frequency_penalty), float(p.repetition_penalty))
    return logits


def process_rows(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """logits (B, G, V) -> processed logits (B, G, V), float32 (float64 for float64 logits);
    rows without processors are only cast. Row b uses rows[b]."""
    B = logits.shape[0]
    assert len(rows) == B, f"{len(rows)} histories for {B} logit rows"
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = logits.to(dtype)
    if out is logits:
        out = out.clone()
    for b, h in enumerate(rows):
        if h.params.has_processors:
            out[b] = process_row(out[b], h)
    return out
