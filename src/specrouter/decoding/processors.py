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

Cost (issue 31): steps 4-5 touch only the columns of tokens in a row's history. Where the native
kernels are built, every penalized row at every position is ONE native call in place
(`penalize_native`: kernels/penalty.cpp, reading each row's PenaltyMemo arrays through torch
views and its draft path; the path tokens before a row's first position, a drafter's own earlier
tokens, counted at every position, the later ones, a verifier's candidates, from their position
on), and the executor processes the forward's logits in place (`process_rows(inplace=True)`: no
copy of the vocabulary). Elsewhere the numpy pass (`penalty_columns` + `penalize`: a flat (G, N)
layout of all rows' history columns, numpy take/put on the host tensor's flat view), the
native call's reference, bit for bit. A row's committed history is kept on its Sequence as a
`PenaltyMemo`, brought up to date incrementally (a cycle appends a few tokens). In the engine
these calls run between model forwards, with the caches cold: each numpy or torch call costs
~5-30 us there against ~1 us in a loop, so what counts is how FEW calls a step makes
(benchmarks/processors_micro.py `--cold`): one row, one position, cold, SPR: ~185 us a call
with the copy and the numpy pass, ~35 us in place and native (session 20). Steps 0-3 are per
row (only rows that have them). tests/processors_reference.py keeps the per-position reference
this equals bit for bit (tests/test_processors_fast.py, both paths).
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
        self._views: tuple | None = None  # torch views of (cols, in_prompt, counts), while they are these arrays

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """torch views (no copy) of `cols`, `in_prompt`, `counts` (the native penalties' input);
        new ones after the arrays grew."""
        if self._views is None or self._views[0] is not self.cols:
            self._views = (self.cols, torch.from_numpy(self.cols), torch.from_numpy(self.in_prompt),
                           torch.from_numpy(self.counts))
        return self._views[1:]

    def _grow(self, need: int) -> None:
        """Capacity for `need` columns (x2 steps; new slots: not in the prompt, count 0)."""
        while need > len(self.cols):
            self.cols = np.concatenate([self.cols, np.empty_like(self.cols)])
            self.in_prompt = np.concatenate([self.in_prompt, np.zeros_like(self.in_prompt)])
            self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])

    def _column(self, t: int) -> int:
        j = self.index.get(t)
        if j is None:
            j = self.index[t] = self.size
            self._grow(j + 1)  # (before indexing: it may grow the arrays)
            self.cols[j] = t
            self.in_prompt[j] = False  # (a draft path's scratch column may have been here)
            self.counts[j] = 0.0
            self.size += 1
        return j

    def path_columns(self, path: list[int]) -> tuple[list[int], int]:
        """The column of each draft-path token, and the number of columns to read: a committed
        token's own column; another token gets a scratch column after `size` (not in the
        prompt, count 0), valid until the next call (no array is rebuilt for them)."""
        js, extra = [], {}
        for t in path:
            j = self.index.get(t)
            if j is None:
                j = extra.get(t)
                if j is None:
                    j = extra[t] = self.size + len(extra)
            js.append(j)
        n = self.size + len(extra)
        if extra:
            self._grow(n)
            self.cols[self.size : n] = list(extra)
            self.in_prompt[self.size : n] = False
            self.counts[self.size : n] = 0.0
        return js, n

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
    row by row): what `penalize` reads. A penalty every row shares is one number (a single
    stream's case: no per-column array to build)."""

    index: np.ndarray  # (N,) int64: the column's index in the flattened (B * G * V) logits at position 0 (+ g * V at g)
    in_prompt: np.ndarray  # (N,) bool
    counts: np.ndarray  # (N,) float64: generated occurrences before position 0 (committed + the path before it)
    path_entry: list[tuple[int, int]]  # (first, column) of each draft-path token that counts only from
    #                                    logit position `first` >= 1 on (a verifier's candidates)
    presence: np.ndarray | float  # (N,) float64 per column, or every row's value (0: off)
    frequency: np.ndarray | float  # (0: off)
    repetition: np.ndarray | float  # (1: off)


def penalty_columns(rows: list[tuple[int, RowHistory, PenaltyMemo]], G: int, V: int) -> PenaltyColumns:
    """The columns of every (logits row b, history, up-to-date memo): a row's committed
    distinct tokens, then the path tokens (path[: offset + G - 1]) not among them. Path token i
    counts from position i - offset + 1 on: the ones before the row's first position
    (i < offset: a drafter's own earlier tokens) are added to the counts; the others (a
    verifier's candidates) are `path_entry`. One row: views of its memo's arrays."""
    parts, path_entry, sizes = [], [], []
    base = 0
    for b, h, m in rows:
        used = h.path[: h.offset + G - 1]
        js, n = m.path_columns(used) if used else ((), m.size)
        counts = m.counts[:n]
        fold = min(h.offset, len(js))  # path tokens before position 0: counted at every position
        if fold:
            counts = counts.copy()
            for j in js[:fold]:
                counts[j] += 1.0
        path_entry += [(i - h.offset + 1, base + js[i]) for i in range(fold, len(js))]
        parts.append((m.cols[:n] + b * G * V if b else m.cols[:n], m.in_prompt[:n], counts))
        sizes.append(n)
        base += n

    def per_column(name: str) -> np.ndarray | float:
        values = [getattr(h.params, name) for _, h, _ in rows]
        if all(v == values[0] for v in values):
            return values[0]
        return np.repeat(np.array(values, dtype=np.float64), sizes)

    index, in_prompt, counts = (np.concatenate(a) if len(a) > 1 else a[0] for a in zip(*parts))
    return PenaltyColumns(
        index=index, in_prompt=in_prompt, counts=counts,
        path_entry=path_entry,
        presence=per_column("presence_penalty"), frequency=per_column("frequency_penalty"),
        repetition=per_column("repetition_penalty"))


def _is(value: np.ndarray | float, neutral: float) -> bool:
    return not isinstance(value, np.ndarray) and value == neutral


def penalize(flat: np.ndarray, G: int, V: int, c: PenaltyColumns) -> None:
    """Steps 4-5 for every column of `c` at every position, in place: `flat` the (B * G * V)
    float32 or float64 logits (a contiguous host tensor's numpy view). The same operations, in
    the same dtype and order, as the per-position definition on each row's history columns
    (others are untouched); a row with r = 1 (f = 0, p = 0) among others that penalize gets
    x / 1 = x * 1 = x (x - 0 * count = x, x - 0 = x): exactly its logits."""
    dt = flat.dtype.type
    N = c.index.shape[0]
    if N == 0:
        return
    at = c.index if G == 1 else c.index + np.arange(0, G * V, V, dtype=np.int64)[:, None]  # (N,) or (G, N)
    x = flat.take(at)
    if c.path_entry:  # the committed counts + the path tokens before each position: (G, N)
        counts = np.empty((G, N), dtype=dt)
        counts[:] = c.counts
        for first, j in c.path_entry:
            counts[first:, j] += 1
    else:  # the same at every position: (N,)
        counts = c.counts.astype(dt)
    present = counts > 0  # (N,) or (G, N)
    if not _is(c.repetition, 1.0):
        rep = c.repetition.astype(dt) if isinstance(c.repetition, np.ndarray) else dt(c.repetition)
        x = np.where(c.in_prompt | present, np.where(x > 0, x / rep, x * rep), x)
    if not _is(c.frequency, 0.0):
        x = x - (c.frequency.astype(dt) if isinstance(c.frequency, np.ndarray) else dt(c.frequency)) * counts
    if not _is(c.presence, 0.0):
        x = x - (c.presence.astype(dt) if isinstance(c.presence, np.ndarray) else dt(c.presence)) * present.astype(dt)
    flat.put(at, x)


NATIVE = True  # tests / benchmarks: False keeps `penalize` on numpy (the native kernel's reference)


def _native_penalize():
    """kernels/penalty.cpp's `penalize_rows` where the kernels are built, else None."""
    if not NATIVE:
        return None
    from specrouter.models.runners.kernels import rowinv

    ops = rowinv()
    return None if ops is None else ops.penalize_rows


def penalize_native(native, out: torch.Tensor, rows: list[tuple[int, RowHistory, PenaltyMemo]]) -> None:
    """Steps 4-5 for every (logits row b, history, up-to-date memo) of `rows` at every position,
    in place on contiguous host logits `out` (B, G, V): ONE native call (kernels/penalty.cpp, the
    same operations as `penalty_columns` + `penalize`, bit for bit), reading the memos' arrays
    where they are (torch views) and each row's draft path."""
    G = out.shape[1]
    path, starts = [], [0]
    for _, h, _ in rows:
        path += h.path[: h.offset + G - 1]
        starts.append(len(path))
    views = [m.views() for _, _, m in rows]
    native(out, [b for b, _, _ in rows], [v[0] for v in views], [v[1] for v in views], [v[2] for v in views],
           [m.size for _, _, m in rows], path, starts, [h.offset for _, h, _ in rows],
           [float(h.params.presence_penalty) for _, h, _ in rows], [float(h.params.frequency_penalty) for _, h, _ in rows],
           [float(h.params.repetition_penalty) for _, h, _ in rows])


def process_rows(logits: torch.Tensor, rows: list[RowHistory | None], inplace: bool = False) -> torch.Tensor:
    """logits (B, G, V) on the host -> processed logits (B, G, V), float32 (float64 for
    float64 logits); rows without processors (or None: decoding/lazy_mask.py) are only cast.
    Row b uses rows[b]. `inplace`: a float32 / float64 contiguous `logits` is processed where it
    is (its rows with processors changed; no copy of the vocabulary: the executor's fresh forward
    output) and returned."""
    B, G = logits.shape[:2]
    assert len(rows) == B, f"{len(rows)} histories for {B} logit rows"
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if logits.dtype != dtype:
        out = logits.to(dtype)
    elif inplace and logits.is_contiguous():
        out = logits
    else:
        out = logits.clone()
    return _process_into(out, rows)


def _process_into(out: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """`process_rows` on `out`, its own (B, G, V) float32 / float64 logits: changed in place (a
    contiguous copy first if it is not contiguous) and returned."""
    G = out.shape[1]
    penalized, memos = [], set()
    for b, h in enumerate(rows):
        if h is None or not h.params.has_processors:  # (None: the caller masks that row lazily)
            continue
        memo = h.memo if h.memo is not None and id(h.memo) not in memos else PenaltyMemo()
        memos.add(id(memo))  # (one memo per row: its scratch columns are the row's)
        p = h.params
        if h.grammar is not None or p.allowed_token_ids is not None or p.logit_bias or p.min_tokens:
            if out.is_inference() and not torch.is_inference_mode_enabled():
                with torch.inference_mode():  # (the forward's logits are inference tensors: written here)
                    out[b] = mask_row(out[b], h, memo)
            else:
                out[b] = mask_row(out[b], h, memo)
        if h.penalized:
            memo.update(h.tokens, h.prompt_len)
            penalized.append((b, h, memo))
    if penalized:
        if not out.is_contiguous():
            out = out.contiguous()
        native = _native_penalize()
        if native is not None:
            penalize_native(native, out, penalized)
        else:
            penalize(out.numpy().reshape(-1), G, out.shape[2], penalty_columns(penalized, G, out.shape[2]))
    return out


def process_row(logits: torch.Tensor, h: RowHistory) -> torch.Tensor:
    """One row's processors (module docstring order): logits (G, V) -> (G, V)."""
    return process_rows(logits[None], [h])[0]
