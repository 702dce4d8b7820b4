"""Model-free suffix drafter ("suffix decoding", arXiv 2411.04975): drafts from what followed
the context's suffix in the request itself AND in earlier requests, scored by frequency.

Two trees, both implicit (a suffix tree's node is the set of corpus positions where a pattern
ends; its children are the tokens that follow them, counted):
- the **request tree**: the row's own context (prompt + output so far), searched like the
  n-gram drafter (no state: the context is the corpus);
- the **global tree**: the prompts and outputs of earlier finished requests (`observe_request`,
  fed by the engine), kept in a `SuffixStore` per tenant: one token buffer with a separator
  between requests and a sorted index of its bigrams, so finding every occurrence of the
  context's last two tokens is a binary search.

One proposal (pure functions `match` and `walk`):
1. match: the occurrences of the longest suffix of the context (at most `max_depth` tokens, at
   least `min_match`) found in the corpus (the most recent `max_occurrences` of its last
   tokens are considered); `n` = that match length.
2. walk: from those occurrences, repeatedly take the most frequent next token; its confidence
   is count(token) / count(occurrences still alive) (an occurrence ending at a separator or at
   the end of the context counts in the denominator), the proposal's cumulative probability
   the product of those. The proposal stops before the cumulative probability drops below
   `min_token_prob`, at `ceil(max_spec_factor * n)` tokens (a short match predicts little),
   or at the k the router asked for: the draft length is sized by the drafter's confidence.
3. Of the two trees' proposals the one with the larger score (sum of cumulative
   probabilities: the expected accepted length under the frequency model) is drafted.

Memory is bounded: at most `max_tokens` tokens over all tenants; inserting past that evicts
whole requests, oldest first, down to 7/8 of the bound (so the O(N) rebuild of an eviction is
paid once per ~N/8 inserted tokens). `memory()` reports tokens, requests, tenants and bytes (the
server exports them as metrics). Bytes per token ~ 4 (buffer) + 16 (index key + position).

Thread safety: every store is replaced, never mutated in place (inserts and evictions build
new arrays under one lock and swap them in), so `propose` reads a consistent snapshot without
locking; `observe_request` may run on any thread.

Tenants: `observe_request(tokens, tenant=...)` and `propose(..., tenants=[...])` keep one store
per tenant key (None: the shared store). The server passes a key derived from the request's
Authorization header when `ServerConfig.suffix_scope == "api-key"`; otherwise every request
is tenant None. The request tree is always private to its row.

Exactness: like the n-gram drafter its proposal distribution is one-hot on the proposed tokens
(the executor builds it), so greedy output is the target's token for token and speculative
sampling stays lossless; what it learned only changes how much is drafted.

Numbers (this machine, 2 cores): see `benchmarks/suffix_micro.py` (propose ~0.1 ms per row with
a 256k-token global store; insert ~1-2 ms per finished request).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specrouter.decoding.drafters.base import as_int64, draft_lengths, pad_drafts

__all__ = ["SuffixConfig", "SuffixDrafter", "SuffixStore", "Proposal", "match", "walk"]

SEPARATOR = -1  # between requests in a store's buffer; matches no token


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix drafter."""

    max_depth: int = 32  # longest context suffix matched (the tree's depth)
    min_match: int = 2  # shortest suffix match that may propose (>= 2: the index is of bigrams)
    min_token_prob: float = 0.1  # stop before the proposal's cumulative probability drops below this
    max_spec_factor: float = 2.0  # a match of n tokens proposes at most ceil(factor * n) tokens
    max_occurrences: int = 4096  # most recent occurrences of a match considered (bounds the cost)
    max_tokens: int = 262_144  # tokens kept in the global trees of all tenants (oldest requests evicted)
    max_request_tokens: int = 8192  # longest request inserted (its last tokens; longer ones are cut)
    global_tree: bool = True  # learn across requests (False: the request tree only)

    def __post_init__(self) -> None:
        if not 2 <= self.min_match <= self.max_depth:
            raise ValueError(f"SuffixConfig needs 2 <= min_match <= max_depth, got {self.min_match}, {self.max_depth}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"SuffixConfig.min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_spec_factor <= 0 or self.max_occurrences < 1 or self.max_tokens < 1 or self.max_request_tokens < 2:
            raise ValueError("SuffixConfig: max_spec_factor > 0, max_occurrences >= 1, max_tokens >= 1, "
                             "max_request_tokens >= 2")


@dataclass(frozen=True)
class Proposal:
    """One row's proposal from one tree."""

    tokens: np.ndarray  # (m,) int64 proposed tokens
    confidence: np.ndarray  # (m,) float64 cumulative probability of each prefix (decreasing)
    match_len: int  # length of the matched context suffix (0: no match)

    @property
    def score(self) -> float:
        """Expected accepted tokens under the frequency model."""
        return float(self.confidence.sum())


EMPTY = Proposal(np.zeros(0, np.int64), np.zeros(0), 0)


# ---------------------------------------------------------------------------------------------
# pure functions


def match(corpus: np.ndarray, ends: np.ndarray, context: np.ndarray, depth: int, first: int) -> tuple[np.ndarray, int]:
    """Narrow `ends` (positions in `corpus` where the context's last `first` tokens end) to those
    where the longest suffix of `context` (up to `depth` tokens) ends. Returns (ends, n)."""
    L = context.shape[0]
    best, n = ends, first
    d = first
    while d < min(depth, L) and ends.shape[0] * (min(depth, L) - d) > 4096:  # many: one token at a time
        ends = ends[ends >= d]
        ends = ends[corpus[ends - d] == context[L - 1 - d]]
        if ends.shape[0] == 0:
            return best, n
        best, n = ends, d + 1
        d += 1
    if d >= min(depth, L):
        return best, n
    # few candidates: compare every remaining depth at once
    ds = np.arange(d, min(depth, L))  # (D,)
    idx = ends[:, None] - ds[None, :]  # (E, D)
    got = np.where(idx >= 0, corpus[np.maximum(idx, 0)], SEPARATOR)  # (E, D)
    run = np.cumprod(got == context[L - 1 - ds][None, :], axis=1).sum(axis=1)  # (E,) further matches
    longest = int(run.max())
    return ends[run == longest], d + longest


def walk(corpus: np.ndarray, ends: np.ndarray, limit: int, max_len: int, min_prob: float) -> Proposal:
    """Follow the most frequent continuation of the occurrences ending at `ends` (positions in
    `corpus`, whose tokens at index >= `limit` or equal to SEPARATOR end a continuation)."""
    if ends.shape[0] == 0 or max_len <= 0:
        return EMPTY
    # the continuations (E, max_len); where all of them agree, each token has confidence 1
    idx = ends[:, None] + np.arange(1, max_len + 1)[None, :]  # (E, m)
    cont = np.where(idx < limit, corpus[np.minimum(idx, limit - 1)], SEPARATOR)  # (E, m)
    agree = (cont == cont[0]).all(axis=0) & (cont[0] != SEPARATOR)  # (m,)
    t0 = int(np.argmin(agree)) if not agree.all() else max_len  # leading columns all agree on
    tokens, conf = cont[0, :t0].tolist(), [1.0] * t0
    cum = 1.0
    rows = np.arange(ends.shape[0])
    for t in range(t0, max_len):
        nxt = cont[rows, t]
        valid = nxt[nxt != SEPARATOR]
        if valid.shape[0] == 0:
            break
        if (valid == valid[0]).all():
            tok, count = int(valid[0]), valid.shape[0]
        else:
            values, counts = np.unique(valid, return_counts=True)
            i = int(np.argmax(counts))
            tok, count = int(values[i]), int(counts[i])
        cum *= count / rows.shape[0]
        if cum < min_prob:
            break
        tokens.append(tok)
        conf.append(cum)
        rows = rows[nxt == tok]
    return Proposal(np.asarray(tokens, dtype=np.int64), np.asarray(conf, dtype=np.float64), 0)


def _proposal_cap(cfg: SuffixConfig, n: int, k: int) -> int:
    return min(k, math.ceil(cfg.max_spec_factor * n))


def propose_from_context(context: np.ndarray, k: int, cfg: SuffixConfig) -> Proposal:
    """The request tree: the longest earlier match of the context's suffix in the context."""
    L = context.shape[0]
    if k <= 0 or L < cfg.min_match + 1:
        return EMPTY
    ends = np.flatnonzero(context[: L - 1] == context[L - 1])[-cfg.max_occurrences:]  # earlier occurrences
    if ends.shape[0] == 0:
        return EMPTY
    ends, n = match(context, ends, context, cfg.max_depth, 1)
    if n < cfg.min_match:
        return EMPTY
    p = walk(context, ends, L, _proposal_cap(cfg, n, k), cfg.min_token_prob)
    return Proposal(p.tokens, p.confidence, n)


# ---------------------------------------------------------------------------------------------
# the global tree of one tenant


def _bigram_keys(buf: np.ndarray) -> np.ndarray:
    """(len(buf),) int64: key of the bigram ending at each position (-1 where undefined)."""
    keys = np.full(buf.shape[0], -1, dtype=np.int64)
    if buf.shape[0] > 1:
        a, b = buf[:-1].astype(np.int64), buf[1:].astype(np.int64)
        keys[1:] = np.where((a >= 0) & (b >= 0), (a << 32) | b, -1)
    return keys


@dataclass(frozen=True)
class SuffixStore:
    """An immutable global tree: earlier requests' tokens and the sorted index of their bigrams.
    `insert` / `evict_oldest` return a new store (readers keep a consistent snapshot)."""

    buf: np.ndarray  # (N,) int32 tokens, SEPARATOR before every request
    base: int  # absolute position of buf[0]
    keys: np.ndarray  # (M,) int64 sorted bigram keys
    ends: np.ndarray  # (M,) int64 absolute end positions, ascending within a key
    lengths: tuple[int, ...]  # buffer length of every request kept (separator included), oldest first

    @classmethod
    def empty(cls) -> "SuffixStore":
        return cls(np.zeros(0, np.int32), 0, np.zeros(0, np.int64), np.zeros(0, np.int64), ())

    @property
    def num_tokens(self) -> int:
        return int(self.buf.shape[0]) - len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes + self.keys.nbytes + self.ends.nbytes)

    def insert(self, tokens: np.ndarray) -> "SuffixStore":
        seg = np.concatenate([np.array([SEPARATOR], np.int32), tokens.astype(np.int32)])
        start = self.base + self.buf.shape[0]  # absolute position of seg[0]
        seg_keys = _bigram_keys(seg)
        keep = np.flatnonzero(seg_keys >= 0)
        order = np.argsort(seg_keys[keep], kind="stable")
        new_keys, new_ends = seg_keys[keep][order], (start + keep[order]).astype(np.int64)
        at = np.searchsorted(self.keys, new_keys, side="right")  # after older equal keys
        return SuffixStore(np.concatenate([self.buf, seg]), self.base,
                           np.insert(self.keys, at, new_keys), np.insert(self.ends, at, new_ends),
                           self.lengths + (int(seg.shape[0]),))

    def evict_oldest(self, count: int = 1) -> "SuffixStore":
        """The store without its `count` oldest requests."""
        n = sum(self.lengths[:count])
        new_base = self.base + n
        keep = self.ends >= new_base
        return SuffixStore(self.buf[n:].copy(), new_base, self.keys[keep], self.ends[keep], self.lengths[count:])

    def propose(self, context: np.ndarray, k: int, cfg: SuffixConfig) -> Proposal:
        L = context.shape[0]
        if k <= 0 or L < cfg.min_match or self.keys.shape[0] == 0:
            return EMPTY
        a, b = int(context[L - 2]), int(context[L - 1])
        if a < 0 or b < 0:
            return EMPTY
        key = (a << 32) | b
        lo, hi = np.searchsorted(self.keys, [key, key + 1])
        if hi <= lo:
            return EMPTY
        ends = self.ends[max(lo, hi - cfg.max_occurrences):hi] - self.base  # most recent ones
        ends, n = match(self.buf, ends, context, cfg.max_depth, 2)
        if n < cfg.min_match:
            return EMPTY
        p = walk(self.buf, ends, self.buf.shape[0], _proposal_cap(cfg, n, k), cfg.min_token_prob)
        return Proposal(p.tokens, p.confidence, n)


# ---------------------------------------------------------------------------------------------
# the drafter


@dataclass(frozen=True)
class SuffixMemory:
    """What the global trees hold now (metrics)."""

    tokens: int  # tokens kept, all tenants
    requests: int  # requests kept
    tenants: int  # stores (None, the shared one, included)
    bytes: int  # buffer + index bytes
    evicted_requests: int  # requests evicted since start
    proposals: int  # row proposals made (shadow ones included; counted without a lock: approximate)
    propose_seconds: float  # their wall time


class SuffixDrafter:
    """Proposes draft tokens by suffix decoding (no model). Name in a pool: "suffix".

    Like `NgramDrafter` its proposal may be shorter than k (even empty: a miss); unlike it, it
    learns across requests (`observe_request`) and reports per-token confidences
    (`propose_scored`)."""

    name = "suffix"
    is_model_free = True

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._stores: dict[str | None, SuffixStore] = {}
        self._order: deque[str | None] = deque()  # tenant of every request kept, oldest first
        self._tokens = 0
        self._evicted = 0
        self._proposals, self._propose_seconds = 0, 0.0
        self._lock = threading.Lock()

    def fresh(self) -> "SuffixDrafter":
        """A drafter with the same settings and nothing learned."""
        return SuffixDrafter(self.config)

    # -- learning ---------------------------------------------------------------------------
    def observe_request(self, tokens: Sequence[int] | np.ndarray, tenant: str | None = None) -> None:
        """Add a finished request's tokens (prompt + output) to its tenant's global tree,
        evicting the oldest requests (of any tenant) past `max_tokens`."""
        cfg = self.config
        if not cfg.global_tree:
            return
        arr = as_int64(tokens)[-cfg.max_request_tokens:]
        if arr.shape[0] < 2:
            return
        arr = arr[-cfg.max_tokens:]
        with self._lock:
            store = self._stores.get(tenant) or SuffixStore.empty()
            self._stores[tenant] = store.insert(arr)
            self._order.append(tenant)
            self._tokens += int(arr.shape[0])
            if self._tokens > cfg.max_tokens:
                # evict down to 7/8 of the bound: the O(N) rebuild is paid once per ~N/8 tokens
                drop: dict[str | None, int] = {}
                while len(self._order) > 1 and self._tokens > cfg.max_tokens * 7 // 8:  # keep the newest
                    old = self._order.popleft()
                    i = drop.get(old, 0)
                    self._tokens -= self._stores[old].lengths[i] - 1
                    drop[old] = i + 1
                for old, n in drop.items():
                    st = self._stores[old].evict_oldest(n)
                    self._evicted += n
                    if st.lengths:
                        self._stores[old] = st
                    else:
                        del self._stores[old]

    def clear(self) -> None:
        with self._lock:
            self._stores.clear()
            self._order.clear()
            self._tokens = 0

    def memory(self) -> SuffixMemory:
        with self._lock:
            stores = list(self._stores.values())
        return SuffixMemory(tokens=sum(s.num_tokens for s in stores), requests=sum(len(s.lengths) for s in stores),
                            tenants=len(stores), bytes=sum(s.nbytes for s in stores),
                            evicted_requests=self._evicted, proposals=self._proposals,
                            propose_seconds=self._propose_seconds)

    # -- proposing --------------------------------------------------------------------------
    def propose_row(self, context: np.ndarray, k: int, tenant: str | None = None) -> Proposal:
        """The better of the request tree's and the tenant's global tree's proposals."""
        cfg = self.config
        if k <= 0:
            return EMPTY
        own = propose_from_context(context, k, cfg)
        store = self._stores.get(tenant) if cfg.global_tree else None  # one atomic read: a snapshot
        if store is None or own.tokens.shape[0] >= k and own.confidence[-1] >= 1.0:
            return own  # nothing to learn from, or a certain full proposal (a score of k)
        other = store.propose(context, k, cfg)
        return other if other.score > own.score else own

    def propose_scored(
        self,
        contexts: Sequence[Sequence[int]] | Sequence[np.ndarray] | Sequence[torch.Tensor],
        k: int | Sequence[int],
        tenants: Sequence[str | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, max k) int64 right-padded with 0, lengths (B,) int64, confidence (B, max k)
        float64: the cumulative probability of each proposed prefix, 0 past the length)."""
        B = len(contexts)
        ks = draft_lengths(k, B)
        if tenants is not None and len(tenants) != B:
            raise ValueError(f"propose: {len(tenants)} tenants for {B} contexts")
        t0 = time.perf_counter()
        props = [self.propose_row(as_int64(ctx), kb, None if tenants is None else tenants[b])
                 for b, (ctx, kb) in enumerate(zip(contexts, ks))]
        width = max(ks, default=0)
        tokens, lengths = pad_drafts([p.tokens for p in props], width)  # (B, max k), (B,)
        conf, _ = pad_drafts([p.confidence for p in props], width, np.float64)  # (B, max k)
        self._proposals += B
        self._propose_seconds += time.perf_counter() - t0
        return torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(conf)

    def propose(self, contexts, k, tenants: Sequence[str | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for every row (the `ModelFreeDrafter` interface): (tokens (B, max k), lengths (B,))."""
        tokens, lengths, _ = self.propose_scored(contexts, k, tenants)
        return tokens, lengths
