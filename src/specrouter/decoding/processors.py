"""Logits processors: the request's sampling controls that depend on the tokens before a
position (penalties, min_tokens) or on fixed token sets (logit_bias, allowed_token_ids).

Every level of a chain (drafter, verifiers, target) and plain decoding run the SAME
`process_rows` on their logits before `sampling.choose_tokens`, with the history each position
really has: the committed tokens plus the candidates before it along the draft path (a
verifier's position g follows the g candidates before it; a drafter's step i follows its own
i draft tokens). So at every position every level samples from the same processed
distribution, and the target's output is exactly plain decoding's under the same controls.

Order and definitions (vLLM's), per row, on raw logits:
0. grammar (decoding/grammar.py): tokens the row's grammar refuses at a position get -inf
   (the row's matcher advanced along the same path).
1. allowed_token_ids: every other token gets -inf.
2. logit_bias: `logits[t] += bias` (OpenAI: added to the logits before sampling).
3. min_tokens: while fewer than min_tokens tokens were generated before a position, the row's
   stop tokens (EOS unless ignore_eos, and its stop_token_ids) get -inf, except where they
   are the only tokens left (a complete grammar allows only EOS): there they go through.
4. repetition_penalty r (CTRL, vLLM): a token seen in the prompt or the generated tokens gets
   `logit / r` if its logit > 0, else `logit * r`.
5. frequency_penalty f, presence_penalty p (OpenAI): over the GENERATED tokens only,
   `logit -= f * count + p * (count > 0)` (two roundings: `- f * count`, then `- p`).
Then sampling.py: temperature, min_p, top-k, top-p (greedy rows: the argmax of the processed
logits). Computation is float32 (float64 for float64 logits).

Cost (issue 31): steps 4-5 touch only the columns of tokens in a row's history, and run for
every position of every row in ONE pass (`penalize`: a flat (G, N) layout of all rows' history
columns, N = their sum, numpy on the host tensor: a handful of array operations whatever the
rows and positions). A row's committed history is kept on its Sequence as a `PenaltyMemo`,
brought up to date incrementally (a cycle appends a few tokens); the draft path's tokens before
each position are a cumulative count over positions. Steps 0-3 are per row (only rows that
have them). tests/processors_reference.py keeps the per-position reference this equals bit for
bit (tests/test_processors_fast.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specrouter.config import SamplingParams


class PenaltyMemo:
    """A row's committed history as the penalties read it, kept on its Sequence: its distinct
    tokens `cols[:size]` (prompt and generated), whether each is in the prompt, how often each
    was generated, and `index` (token -> column). `update` counts the tokens committed since
    the last call (a Sequence only appends); the mask/bias term of step 1-2 is cached here."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.cols = np.empty(16, dtype=np.int64)  # (cap,) token ids, the first `size` valid
        self.in_prompt = np.zeros(16, dtype=bool)  # (cap,)
        self.counts = np.zeros(16, dtype=np.float64)  # (cap,) occurrences among the generated tokens
        self.size = 0
        self.counted = 0  # committed tokens accounted for
        self.last: int | None = None  # tokens[counted - 1] when counted
        self.add_term: dict[tuple[int, torch.dtype], torch.Tensor | None] = {}  # (V, dtype) -> step 1-2 term

    def _column(self, t: int) -> int:
        j = self.index.get(t)
        if j is None:
            j = self.index[t] = self.size
            if j == len(self.cols):  # grow x2
                self.cols = np.concatenate([self.cols, np.empty_like(self.cols)])
                self.in_prompt = np.concatenate([self.in_prompt, np.zeros_like(self.in_prompt)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.cols[j] = t
            self.size += 1
        return j

    def update(self, tokens: list[int], prompt_len: int) -> None:
        """Account for tokens[self.counted:]. A sequence that no longer holds what was counted
        (shorter, or another last token: a row rolled back by failure isolation) starts over."""
        if self.counted and (len(tokens) < self.counted or tokens[self.counted - 1] != self.last):
            self.__init__()
        if self.counted < prompt_len:
            for t in tokens[self.counted : prompt_len]:
                j = self._column(t)  # (before indexing: it may grow the arrays)
                self.in_prompt[j] = True
            self.counted = prompt_len
        for t in tokens[self.counted :]:
            j = self._column(t)
            self.counts[j] += 1.0
        self.counted = len(tokens)
        self.last = tokens[-1] if tokens else None


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
    # the row's PenaltyMemo (kept on its Sequence across calls); None: a fresh one for this call
    memo: PenaltyMemo | None = field(default=None, compare=False)

    @property
    def penalized(self) -> bool:
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def token_mask_and_bias(params: SamplingParams, vocab: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The (V,) additive term of allowed_token_ids (-inf outside) and logit_bias, or None."""
    if params.allowed_token_ids is None and not params.logit_bias:
        return None
    add = torch.zeros(vocab, dtype=dtype)
    if params.allowed_token_ids is not None:
        add.fill_(float("-inf"))
        add[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = 0.0
    for t, b in params.logit_bias:
        add[t] += b
    return add


def never_empty(masked: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`masked` (G, V), except at positions where it allows nothing: there `logits` (min_tokens
    never masks the only tokens left: a complete grammar, allowed_token_ids of stop tokens;
    the stop tokens go through and end the row)."""
    empty = torch.isneginf(masked).all(dim=-1)  # (G,)
    return torch.where(empty[:, None], logits, masked)


def mask_row(logits: torch.Tensor, h: RowHistory, memo: PenaltyMemo | None = None) -> torch.Tensor:
    """One row's steps 0-3 (grammar, allowed_token_ids, logit_bias, min_tokens): logits (G, V)
    -> (G, V). `memo` caches the step 1-2 term."""
    G, V = logits.shape
    p = h.params
    if h.grammar is not None:
        allowed = h.grammar.allowed(h.tokens[h.prompt_len :], h.path, h.offset, G)  # (G, V)
        logits = logits.masked_fill(~allowed, float("-inf"))
    if p.allowed_token_ids is not None or p.logit_bias:
        key = (V, logits.dtype)
        add = memo.add_term.get(key) if memo is not None else None
        if add is None:
            add = token_mask_and_bias(p, V, logits.dtype)
            if memo is not None:
                memo.add_term[key] = add
        logits = logits + add[None, :]
    if p.min_tokens:
        generated = len(h.tokens) - h.prompt_len + h.offset + torch.arange(G)  # (G,) before each position
        early = generated < p.min_tokens  # (G,)
        stops = [t for t in h.stop_ids if t < V]
        if bool(early.any()) and stops:
            masked = logits.clone()
            cols = torch.tensor(stops, dtype=torch.long)
            masked[early.nonzero().flatten()[:, None], cols[None, :]] = float("-inf")
            logits = never_empty(masked, logits)
    return logits


@dataclass(frozen=True)
class PenaltyColumns:
    """The flat layout of the penalized rows' history columns for one call (N columns in all,
    row by row): what `penalize` reads."""

    batch_index: np.ndarray  # (N,) int64: the logits row of each column
    token: np.ndarray  # (N,) int64: its token id
    in_prompt: np.ndarray  # (N,) bool
    counts: np.ndarray  # (N,) float64: generated occurrences among the committed tokens
    path_entry: np.ndarray  # (P,) int64: first * N + column of each draft-path token in use (it
    #                         counts from logit position `first` on)
    presence: np.ndarray | None  # (N,) float64: the column's row's presence penalty (None: all 0)
    frequency: np.ndarray | None  # (N,) (None: all 0)
    repetition: np.ndarray | None  # (N,) (None: all 1)


def penalty_columns(rows: list[tuple[int, RowHistory, PenaltyMemo]], G: int) -> PenaltyColumns:
    """The columns of every (logits row b, history, up-to-date memo): a row's committed
    distinct tokens, then the path tokens (path[: offset + G - 1]) not among them. Path token i
    counts from position i - offset + 1 on (clamped to 0)."""
    parts, pcol, pfirst, sizes, pres, freq, rep = [], [], [], [], [], [], []
    base = 0
    for b, h, m in rows:
        extra: dict[int, int] = {}
        for i, t in enumerate(h.path[: h.offset + G - 1]):
            j = m.index.get(t)
            if j is None:
                j = extra.get(t)
                if j is None:
                    j = extra[t] = m.size + len(extra)
            pcol.append(base + j)
            pfirst.append(max(i - h.offset + 1, 0))
        parts.append((m.cols[: m.size], m.in_prompt[: m.size], m.counts[: m.size]))
        if extra:
            parts.append((np.fromiter(extra, dtype=np.int64, count=len(extra)), np.zeros(len(extra), dtype=bool),
                          np.zeros(len(extra))))
        n = m.size + len(extra)
        sizes.append(n)
        p = h.params
        pres.append(p.presence_penalty)
        freq.append(p.frequency_penalty)
        rep.append(p.repetition_penalty)
        base += n
    sizes = np.array(sizes, dtype=np.int64)

    def per_column(values: list[float], neutral: float) -> np.ndarray | None:
        if all(v == neutral for v in values):
            return None
        return np.repeat(np.array(values, dtype=np.float64), sizes)

    token, in_prompt, counts = (np.concatenate(a) if len(a) > 1 else a[0] for a in zip(*parts))
    return PenaltyColumns(
        batch_index=np.repeat(np.array([b for b, _, _ in rows], dtype=np.int64), sizes), token=token,
        in_prompt=in_prompt, counts=counts,
        path_entry=np.array(pfirst, dtype=np.int64) * base + np.array(pcol, dtype=np.int64),
        presence=per_column(pres, 0.0), frequency=per_column(freq, 0.0), repetition=per_column(rep, 1.0))


def penalize(logits: np.ndarray, c: PenaltyColumns) -> None:
    """Steps 4-5 for every column of `c` at every position, in place: logits (B, G, V) float32
    or float64 (a host tensor's numpy view). The same operations, in the same dtype and order,
    as the per-position definition on each row's history columns (others are untouched); a
    row with r = 1 (f = 0, p = 0) among others that penalize gets x / 1 = x * 1 = x
    (x - 0 * count = x, x - 0 = x): exactly its logits."""
    G = logits.shape[1]
    dt = logits.dtype
    N = c.token.shape[0]
    if N == 0:
        return
    at = (c.batch_index[None, :], np.arange(G)[:, None], c.token[None, :])  # (G, N) each, broadcast
    x = logits[at]  # (G, N)
    counts = c.counts.astype(dt)  # (N,): the committed history, the same at every position
    if c.path_entry.shape[0]:  # + the path tokens before each position: (G, N)
        counts = counts + np.cumsum(np.bincount(c.path_entry, minlength=G * N).reshape(G, N), axis=0, dtype=dt)
    present = counts > 0  # (G, N) or (N,)
    if c.repetition is not None:
        rep = c.repetition.astype(dt)
        x = np.where(c.in_prompt | present, np.where(x > 0, x / rep, x * rep), x)
    if c.frequency is not None:
        x = x - c.frequency.astype(dt) * counts
    if c.presence is not None:
        x = x - c.presence.astype(dt) * present.astype(dt)
    logits[at] = x


def process_rows(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """logits (B, G, V) on the host -> processed logits (B, G, V), float32 (float64 for
    float64 logits); rows without processors are only cast. Row b uses rows[b]."""
    B, G = logits.shape[:2]
    assert len(rows) == B, f"{len(rows)} histories for {B} logit rows"
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = logits.to(dtype)
    if out is logits:
        out = out.clone()
    penalized = []
    for b, h in enumerate(rows):
        if not h.params.has_processors:
            continue
        memo = h.memo if h.memo is not None else PenaltyMemo()
        p = h.params
        if h.grammar is not None or p.allowed_token_ids is not None or p.logit_bias or p.min_tokens:
            out[b] = mask_row(out[b], h, memo)
        if h.penalized:
            memo.update(h.tokens, h.prompt_len)
            penalized.append((b, h, memo))
    if penalized:
        penalize(out.numpy(), penalty_columns(penalized, G))
    return out


def process_row(logits: torch.Tensor, h: RowHistory) -> torch.Tensor:
    """One row's processors (module docstring order): logits (G, V) -> (G, V)."""
    return process_rows(logits[None], [h])[0]
