"""Model-free suffix drafter ("suffix decoding", arXiv 2411.04975): drafts from what followed
the context's suffix in the request itself AND in earlier requests, scored by frequency.

Two trees, both implicit (a suffix tree's node is the set of corpus positions where a pattern
ends; its children are the tokens that follow them, counted):
- the **request tree**: the row's own context (prompt + output so far), searched like the
  n-gram drafter (no state: the context is the corpus);
- the **global tree**: the prompts and outputs of earlier finished requests (`observe_request`,
  fed by the engine), kept in a `SuffixStore` per tenant: one token buffer with a separator
  between requests and an index of its bigrams, so finding every occurrence of the context's
  last two tokens is a binary search (plus a short scan of the newest ones).

One proposal (pure functions `match` and `walk`):
1. match: the occurrences of the longest suffix of the context (at most `max_depth` tokens, at
   least `min_match` in the global tree, `min_context_match` in the request tree) found in the
   corpus (the most recent `max_occurrences` of its last
   tokens are considered); `n` = that match length.
2. walk: from those occurrences, repeatedly take the most frequent next token; its confidence
   is count(token) / count(occurrences still alive) (an occurrence ending at a separator or at
   the end of the context counts in the denominator), the proposal's cumulative probability
   the product of those. The proposal stops before the cumulative probability drops below
   `min_token_prob` (or the row's `min_confidence`, when higher: the router's break-even
   acceptance, which grows with what verifying a candidate costs), at
   `ceil(max_spec_factor * n)` tokens (a short match predicts little), or at the k the router
   asked for: the draft length is sized by the drafter's confidence.
3. Of the two trees' proposals the one with the larger score (sum of cumulative
   probabilities: the expected accepted length under the frequency model) is drafted.

Insert cost (the engine calls `observe_request` between steps): O(the request's tokens). The
buffer is append-only with room to grow; the index has three parts, oldest first: a sorted run
built at the last compaction, a sorted middle run, and a log of the newest bigrams, unsorted
(at most `LOG_SIZE`, scanned by a lookup only when a bit table says the key may be there). An
insert appends to the buffer and the log; a full log is sorted into the middle run (O(middle
run), once per `LOG_SIZE` bigrams); a compaction (O(N): dead slots dropped, all three parts
merged) runs once per ~N/8 inserted or evicted tokens. On a full 262k-token store: ~0.15 ms per
insert (median; before: ~2.2 ms, O(N) per insert), ~10 ms per compaction, once per ~100
requests of 300 tokens (see `benchmarks/suffix_micro.py`).

Memory is bounded: at most `max_tokens` tokens over all tenants; inserting past that evicts
whole requests, oldest first, down to the bound. Eviction is O(1) per request (the store's
`live` start moves past it); its slots stay, dead, until they are more than 1/8 of the kept
ones or the buffer's room runs out, then the store is compacted. So allocated memory is at most
~(1 + 1/4) of what is kept. `memory()` reports tokens and requests kept, tenants, and bytes
allocated (the server exports them as metrics); ~22 bytes per kept token: 4 (buffer) + 16
(index key + position) + room and bit tables.

Thread safety: a store is an immutable snapshot. The slots it reads (its prefix of the buffer
and of the log) are never written again: an insert writes past the newest snapshot's prefix
(under the drafter's lock) and publishes a new snapshot; sorting the log or compacting builds
new arrays. So `propose` reads a consistent snapshot without locking, and `observe_request`
may run on any thread.

Tenants: `observe_request(tokens, tenant=...)` and `propose(..., tenants=[...])` keep one store
per tenant key (None: the shared store). The server passes a key derived from the request's
Authorization header when `ServerConfig.suffix_scope == "api-key"`; otherwise every request
is tenant None. The request tree is always private to its row.

Exactness: like the n-gram drafter its proposal distribution is one-hot on the proposed tokens
(the executor builds it), so greedy output is the target's token for token and speculative
sampling stays lossless; what it learned only changes how much is drafted.

Numbers (this machine, 2 cores): see `benchmarks/suffix_micro.py` (propose ~0.1-0.4 ms per row
with a 256k-token global store; insert above).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specrouter.drafters.base import EMPTY, Proposal, as_int64, draft_lengths, pad_drafts
from specrouter.drafters.trees import EMPTY_TREE, SEPARATOR, TreeProposal, grow, merge

__all__ = ["SuffixConfig", "SuffixDrafter", "SuffixStore", "Proposal", "match", "walk"]



@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix drafter."""

    max_depth: int = 32  # longest context suffix matched (the tree's depth)
    min_match: int = 2  # shortest suffix match in the global tree that may propose (>= 2: its index is of bigrams)
    # shortest match in the request's own context (1: prompt lookup's shortest n-gram; one-token
    # matches are spread over many continuations, so their confidence is low and the router's
    # floor cuts what does not pay: docs/trees.md "Suffix trees")
    min_context_match: int = 1
    min_token_prob: float = 0.1  # stop before the proposal's cumulative probability drops below this
    max_spec_factor: float = 2.0  # a match of n tokens proposes at most ceil(factor * n) tokens
    max_occurrences: int = 4096  # most recent occurrences of a match considered (bounds the cost)
    max_tokens: int = 262_144  # tokens kept in the global trees of all tenants (oldest requests evicted)
    max_request_tokens: int = 8192  # longest request inserted (its last tokens; longer ones are cut)
    global_tree: bool = True  # learn across requests (False: the request tree only)

    def __post_init__(self) -> None:
        if not 2 <= self.min_match <= self.max_depth:
            raise ValueError(f"SuffixConfig needs 2 <= min_match <= max_depth, got {self.min_match}, {self.max_depth}")
        if not 1 <= self.min_context_match <= self.max_depth:
            raise ValueError(f"SuffixConfig needs 1 <= min_context_match <= max_depth, got {self.min_context_match}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"SuffixConfig.min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_spec_factor <= 0 or self.max_occurrences < 1 or self.max_tokens < 1 or self.max_request_tokens < 2:
            raise ValueError("SuffixConfig: max_spec_factor > 0, max_occurrences >= 1, max_tokens >= 1, "
                             "max_request_tokens >= 2")




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


def context_matches(context: np.ndarray, cfg: SuffixConfig) -> tuple[np.ndarray, int]:
    """The request tree's match: (ends of the earlier occurrences of the context's longest
    suffix in the context itself (at most `max_occurrences`, the most recent), its length n);
    n = 0: none of at least `min_context_match` tokens."""
    L = context.shape[0]
    none = np.zeros(0, np.int64), 0
    if L < cfg.min_context_match + 1:
        return none
    ends = np.flatnonzero(context[: L - 1] == context[L - 1])[-cfg.max_occurrences:]  # earlier occurrences
    if ends.shape[0] == 0:
        return none
    ends, n = match(context, ends, context, cfg.max_depth, 1)
    return (ends, n) if n >= cfg.min_context_match else none


def propose_from_context(context: np.ndarray, k: int, cfg: SuffixConfig, min_prob: float | None = None) -> Proposal:
    """The request tree: the longest earlier match of the context's suffix in the context
    (`min_prob`: where the proposal stops, default `cfg.min_token_prob`)."""
    if k <= 0:
        return EMPTY
    ends, n = context_matches(context, cfg)
    if n == 0:
        return EMPTY
    p = walk(context, ends, context.shape[0], _proposal_cap(cfg, n, k),
             cfg.min_token_prob if min_prob is None else min_prob)
    return Proposal(p.tokens, p.confidence, n)


def tree_from_context(context: np.ndarray, budget: int, k: int, cfg: SuffixConfig, min_prob: float) -> TreeProposal:
    """The request tree's continuations as a token tree (drafters/trees.py): every earlier
    occurrence of the longest matched suffix, at most `budget` nodes, `_proposal_cap` deep."""
    ends, n = context_matches(context, cfg)
    if n == 0 or k <= 0:
        return EMPTY_TREE
    return grow(context, ends, context.shape[0], budget, _proposal_cap(cfg, n, k), min_prob, n)


# ---------------------------------------------------------------------------------------------
# the global tree of one tenant

RESERVE_FRACTION = 8  # a store has room for 1/8 of its kept tokens before it is compacted
MIN_RESERVE = 64  # ... and at least this many
LOG_SIZE = 4096  # newest bigrams kept unsorted (a proposal may scan them), then sorted into the middle run
SEEN_BITS = 16  # bits of a "seen" table per bigram of room (a miss skips the newer parts ~15/16 of the time)


def _bigram_keys(buf: np.ndarray) -> np.ndarray:
    """(len(buf),) int64: key of the bigram ending at each position (-1 where undefined)."""
    keys = np.full(buf.shape[0], -1, dtype=np.int64)
    if buf.shape[0] > 1:
        a, b = buf[:-1].astype(np.int64), buf[1:].astype(np.int64)
        keys[1:] = np.where((a >= 0) & (b >= 0), (a << 32) | b, -1)
    return keys


def _segment_bigrams(seg: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, ends) of the bigrams of a segment whose first token is at absolute `start`, in
    position order: (m,) int64 each."""
    keys = _bigram_keys(seg)
    at = np.flatnonzero(keys >= 0)  # (m,)
    return keys[at], start + at


def _merge(keys: np.ndarray, ends: np.ndarray, new_keys: np.ndarray, new_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sorted index (keys, ends) with newer entries added (every new end > every old one):
    keys stay sorted and ends ascending within a key."""
    order = np.argsort(new_keys, kind="stable")  # new ends ascend: stable keeps them ascending per key
    new_keys = new_keys[order]  # (m,)
    at = np.searchsorted(keys, new_keys, side="right") + np.arange(new_keys.shape[0])  # (m,) after older equal keys
    old = np.ones(keys.shape[0] + new_keys.shape[0], dtype=bool)  # (M + m,) slots of the old entries
    old[at] = False
    out_keys, out_ends = np.empty(old.shape[0], np.int64), np.empty(old.shape[0], np.int64)
    out_keys[old], out_keys[at] = keys, new_keys
    out_ends[old], out_ends[at] = ends, new_ends[order]
    return out_keys, out_ends


def _live(keys: np.ndarray, ends: np.ndarray, live: int) -> tuple[np.ndarray, np.ndarray]:
    keep = ends >= live
    return keys[keep], ends[keep]


class _Arena:
    """Append-only columns shared by successive snapshots of a store, with room to grow. Slots
    below `used` are never written again, so a snapshot reading its own prefix reads what it saw;
    only the snapshot whose length is `used` may append."""

    def __init__(self, capacity: int, dtypes: Sequence, prefix: Sequence[np.ndarray] = ()) -> None:
        self.cols = [np.empty(capacity, dt) for dt in dtypes]  # each (capacity,)
        self.used = 0
        if prefix:
            self.append(0, *prefix)

    @property
    def capacity(self) -> int:
        return int(self.cols[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cols)

    def can_append(self, at: int, m: int) -> bool:
        return self.used == at and at + m <= self.capacity

    def append(self, at: int, *values: np.ndarray) -> None:
        m = values[0].shape[0]
        for col, v in zip(self.cols, values):
            col[at:at + m] = v
        self.used = at + m

    def prefix(self, n: int) -> list[np.ndarray]:
        return [c[:n] for c in self.cols]


def _buffer(tokens: np.ndarray, room: int) -> _Arena:
    return _Arena(tokens.shape[0] + room, [np.int32], [tokens])


def _slot(key, mask: int):
    """Bit of a bigram key (or (m,) keys) in a "seen" bit table of mask + 1 bits."""
    return ((key >> 32) * 40503 + (key & 0xFFFFFFFF)) & mask


def _seen_table(room: int) -> np.ndarray:
    """(S / 8,) uint8 an empty bit table for `room` bigrams."""
    return np.zeros(1 << max(3, (SEEN_BITS * room - 1).bit_length() - 3), dtype=np.uint8)


def _mark(seen: np.ndarray, keys: np.ndarray) -> None:
    bits = _slot(keys, seen.shape[0] * 8 - 1)  # (m,)
    np.bitwise_or.at(seen, bits >> 3, (1 << (bits & 7)).astype(np.uint8))


def _maybe_seen(seen: np.ndarray, key: int) -> bool:
    """False: no key marked in `seen` is `key`."""
    bit = _slot(key, seen.shape[0] * 8 - 1)
    return bool(seen[bit >> 3] & (1 << (bit & 7)))


@dataclass(frozen=True)
class _Run:
    """A sorted part of the index (keys sorted, ends ascending within a key) and the bit table
    of its keys, so that a miss costs no search."""

    keys: np.ndarray  # (M,) int64
    ends: np.ndarray  # (M,) int64 absolute end positions
    seen: np.ndarray  # (S / 8,) uint8 bit table

    def ends_of(self, span: np.ndarray) -> np.ndarray | None:
        """(E,) ends of the key of `span` ([key, key + 1]); None: certainly none."""
        if self.keys.shape[0] == 0 or not _maybe_seen(self.seen, int(span[0])):
            return None
        return _ends_of(self.keys, self.ends, span)


def _ends_of(keys: np.ndarray, ends: np.ndarray, span: np.ndarray) -> np.ndarray:
    """(E,) ends of a key in a sorted index; `span` = [key, key + 1]."""
    lo, hi = keys.searchsorted(span)
    return ends[lo:hi]


class _Log(_Arena):
    """The newest bigrams, unsorted: (keys, absolute ends) in position order, and the bit table
    of their keys (bits are only ever set while the log lives, so a clear bit means no
    snapshot's log holds the key)."""

    def __init__(self, room: int) -> None:
        super().__init__(min(LOG_SIZE, room), [np.int64, np.int64])
        self.room = room
        self.seen = _seen_table(room)  # the middle run's size: its table is this one's OR its own

    def append(self, at: int, *values: np.ndarray) -> None:
        _mark(self.seen, values[0])
        super().append(at, *values)

    def ends_of(self, key: int, r: int) -> np.ndarray | None:
        """(E,) ends of `key` among the first r entries (None: certainly none)."""
        if r == 0 or not _maybe_seen(self.seen, key):
            return None
        keys, ends = self.cols
        return ends[:r][keys[:r] == key]

    @property
    def nbytes(self) -> int:
        return super().nbytes + int(self.seen.nbytes)


EMPTY_INDEX = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def _empty_mid(room: int) -> _Run:
    return _Run(*EMPTY_INDEX, _seen_table(room))


@dataclass(frozen=True)
class SuffixStore:
    """The global tree of one tenant, as an immutable snapshot: earlier requests' tokens and the
    index of their bigrams in three parts, oldest first: a sorted run built at the last
    compaction (`keys`, `ends`), a sorted middle run, a short unsorted log. `insert` /
    `evict_oldest` return a new store and leave this one readable."""

    buffer: _Arena  # tokens, SEPARATOR before every request (position p at p - base); shared
    n: int  # buffer slots of this snapshot
    log: _Log  # (keys, ends) of the newest bigrams, in position order; shared
    r: int  # log entries of this snapshot
    base: int  # absolute position of the buffer's slot 0
    live: int  # absolute position of the oldest kept request (slots before it: evicted, dead)
    keys: np.ndarray  # (M,) int64 sorted bigram keys of the compacted run (some may be dead)
    ends: np.ndarray  # (M,) int64 absolute end positions, ascending within a key
    mid: _Run  # bigrams since the compaction, the log's excepted
    lengths: tuple[int, ...]  # buffer length of every request kept (separator included), oldest first

    @classmethod
    def empty(cls) -> SuffixStore:
        return cls(_buffer(np.zeros(0, np.int32), MIN_RESERVE), 0, _Log(MIN_RESERVE), 0, 0, 0, *EMPTY_INDEX,
                   _empty_mid(MIN_RESERVE), ())

    @property
    def buf(self) -> np.ndarray:
        """(n,) int32 the buffer of this snapshot, dead slots included."""
        return self.buffer.cols[0][: self.n]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths) - len(self.lengths)

    @property
    def dead(self) -> int:
        """Buffer slots of evicted requests, freed at the next compaction."""
        return self.live - self.base

    @property
    def nbytes(self) -> int:
        mid = self.mid.keys.nbytes + self.mid.ends.nbytes + self.mid.seen.nbytes
        return int(self.buffer.nbytes + self.log.nbytes + self.keys.nbytes + self.ends.nbytes + mid)

    def kept(self) -> np.ndarray:
        """(N,) int32 the kept requests' buffer: SEPARATOR then tokens, oldest first."""
        return self.buf[self.dead:]

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, ends) of every kept bigram, sorted as `keys` / `ends` are."""
        newer = _merge(*_live(self.mid.keys, self.mid.ends, self.live), *_live(*self.log.prefix(self.r), self.live))
        return _merge(*_live(self.keys, self.ends, self.live), *newer)

    # -- updates: O(inserted tokens), plus sorting the log into the middle run once per
    # LOG_SIZE bigrams and a compaction (O(kept tokens)) once per ~1/8 of the kept tokens ---
    def insert(self, tokens: np.ndarray) -> SuffixStore:
        seg = np.concatenate([np.array([SEPARATOR], np.int32), tokens.astype(np.int32)])  # (m + 1,)
        if not self.buffer.can_append(self.n, seg.shape[0]):
            return self._compacted(seg)
        keys, ends = _segment_bigrams(seg, self.base + self.n)  # (c,) each
        st = self if self.log.can_append(self.r, keys.shape[0]) else self._log_sorted()
        if not st.log.can_append(st.r, keys.shape[0]):  # longer than the log: sorted in with it
            st = st._log_sorted(keys, ends)
            keys, ends = keys[:0], ends[:0]
        st.buffer.append(st.n, seg)
        st.log.append(st.r, keys, ends)
        return replace(st, n=st.n + seg.shape[0], r=st.r + keys.shape[0], lengths=st.lengths + (int(seg.shape[0]),))

    def evict_oldest(self, count: int = 1) -> SuffixStore:
        """The store without its `count` oldest requests (their slots stay until they are more
        than 1/8 of the kept ones: then it is compacted)."""
        st = replace(self, live=self.live + sum(self.lengths[:count]), lengths=self.lengths[count:])
        return st._compacted() if st.dead > max(MIN_RESERVE, (st.n - st.dead) // RESERVE_FRACTION) else st

    def _log_sorted(self, *extra: np.ndarray) -> SuffixStore:
        """The log (and `extra` newer (keys, ends)) sorted into the middle run; a new, empty log
        (the old one stays as older snapshots read it)."""
        new_keys, new_ends = self.log.prefix(self.r)
        if extra:
            new_keys, new_ends = np.concatenate([new_keys, extra[0]]), np.concatenate([new_ends, extra[1]])
        seen = self.mid.seen | self.log.seen
        if extra:
            _mark(seen, extra[0])
        mid = _Run(*_merge(self.mid.keys, self.mid.ends, new_keys, new_ends), seen)
        return replace(self, mid=mid, log=_Log(self.log.room), r=0)

    def _compacted(self, seg: np.ndarray | None = None) -> SuffixStore:
        """One sorted run and a new buffer with the kept requests (and `seg`): dead slots and
        entries dropped, room for 1/8 of the kept tokens."""
        buf, lengths = self.kept(), self.lengths
        keys, ends = self.index()
        if seg is not None:
            keys, ends = _merge(keys, ends, *_segment_bigrams(seg, self.live + buf.shape[0]))
            buf, lengths = np.concatenate([buf, seg]), lengths + (int(seg.shape[0]),)
        room = max(MIN_RESERVE, (buf.shape[0] - len(lengths)) // RESERVE_FRACTION)
        return SuffixStore(_buffer(buf, room), int(buf.shape[0]), _Log(room), 0, self.live, self.live,
                           keys, ends, _empty_mid(room), lengths)

    # -- reading ---------------------------------------------------------------------------
    def occurrences(self, key: int, limit: int) -> np.ndarray:
        """(E,) int64 absolute end positions, ascending, of the `limit` most recent kept
        occurrences of a bigram."""
        span = np.array([key, key + 1], dtype=np.int64)
        ends = _ends_of(self.keys, self.ends, span)
        mid, log = self.mid.ends_of(span), self.log.ends_of(key, self.r)
        if mid is not None or log is not None:
            ends = np.concatenate([e for e in (ends, mid, log) if e is not None])
        if ends.shape[0] and ends[0] < self.live:
            ends = ends[ends.searchsorted(self.live):]
        return ends[-limit:]

    def matches(self, context: np.ndarray, cfg: SuffixConfig) -> tuple[np.ndarray, int]:
        """(ends in `buf` of the occurrences of the context's longest suffix (the most recent
        `max_occurrences` of its last bigram), its length n); n = 0: no match of `min_match`."""
        L = context.shape[0]
        none = np.zeros(0, np.int64), 0
        if L < cfg.min_match or not self.lengths:
            return none
        a, b = int(context[L - 2]), int(context[L - 1])
        if a < 0 or b < 0:
            return none
        ends = self.occurrences((a << 32) | b, cfg.max_occurrences) - self.base  # (E,) most recent ones
        if ends.shape[0] == 0:
            return none
        ends, n = match(self.buf, ends, context, cfg.max_depth, 2)
        return (ends, n) if n >= cfg.min_match else none

    def propose(self, context: np.ndarray, k: int, cfg: SuffixConfig, min_prob: float | None = None) -> Proposal:
        if k <= 0:
            return EMPTY
        ends, n = self.matches(context, cfg)
        if n == 0:
            return EMPTY
        p = walk(self.buf, ends, self.n, _proposal_cap(cfg, n, k), cfg.min_token_prob if min_prob is None else min_prob)
        return Proposal(p.tokens, p.confidence, n)

    def propose_tree(self, context: np.ndarray, budget: int, k: int, cfg: SuffixConfig, min_prob: float) -> TreeProposal:
        """The global tree's continuations as a token tree (drafters/trees.py)."""
        ends, n = self.matches(context, cfg) if k > 0 else (None, 0)
        if n == 0:
            return EMPTY_TREE
        return grow(self.buf, ends, self.n, budget, _proposal_cap(cfg, n, k), min_prob, n)


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
    sized_by_confidence = True  # propose() takes min_confidence (the router's break-even acceptance)
    proposes_trees = True  # propose_trees(): several continuations weighted by frequency

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
                # evict down to the bound (O(1) per request; the stores compact when it pays)
                drop: dict[str | None, int] = {}
                while len(self._order) > 1 and self._tokens > cfg.max_tokens:  # keep the newest
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
    def propose_row(self, context: np.ndarray, k: int, tenant: str | None = None,
                    min_confidence: float | None = 0.0) -> Proposal:
        """The better of the request tree's and the tenant's global tree's proposals, each
        stopping before its cumulative confidence drops below max(min_token_prob, min_confidence)."""
        cfg = self.config
        if k <= 0:
            return EMPTY
        min_prob = max(cfg.min_token_prob, min_confidence or 0.0)
        own = propose_from_context(context, k, cfg, min_prob)
        store = self._stores.get(tenant) if cfg.global_tree else None  # one atomic read: a snapshot
        if store is None or own.tokens.shape[0] >= k and own.confidence[-1] >= 1.0:
            return own  # nothing to learn from, or a certain full proposal (a score of k)
        other = store.propose(context, k, cfg, min_prob)
        return other if other.score > own.score else own

    def propose_tree_row(self, context: np.ndarray, budget: int, k: int, tenant: str | None = None,
                         min_confidence: float | None = 0.0) -> TreeProposal:
        """Row's token tree (drafters/trees.py): the union of the request tree's and the tenant's
        global tree's continuations, at most `budget` nodes and `k` deep, none below
        max(min_token_prob, min_confidence)."""
        cfg = self.config
        if k <= 0 or budget <= 0:
            return EMPTY_TREE
        min_prob = max(cfg.min_token_prob, min_confidence or 0.0)
        own = tree_from_context(context, budget, k, cfg, min_prob)
        store = self._stores.get(tenant) if cfg.global_tree else None  # one atomic read: a snapshot
        if store is None:
            return own
        return merge([own, store.propose_tree(context, budget, k, cfg, min_prob)], budget)

    def propose_trees(self, contexts, budgets: Sequence[int], k: Sequence[int],
                      tenants: Sequence[str | None] | None = None,
                      min_confidence: Sequence[float] | None = None) -> list[TreeProposal]:
        """`DrafterProtocol.propose_trees`: one token tree per row."""
        B = len(contexts)
        floors = [0.0] * B if min_confidence is None else [float(x) for x in min_confidence]
        t0 = time.perf_counter()
        out = [self.propose_tree_row(as_int64(ctx), n, kb, None if tenants is None else tenants[b], floors[b])
               for b, (ctx, n, kb) in enumerate(zip(contexts, budgets, k))]
        self._proposals += B
        self._propose_seconds += time.perf_counter() - t0
        return out

    def propose_scored(
        self,
        contexts: Sequence[Sequence[int]] | Sequence[np.ndarray] | Sequence[torch.Tensor],
        k: int | Sequence[int],
        tenants: Sequence[str | None] | None = None,
        min_confidence: Sequence[float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, max k) int64 right-padded with 0, lengths (B,) int64, confidence (B, max k)
        float64: the cumulative probability of each proposed prefix, 0 past the length).
        `min_confidence[b]`: row b's proposal stops before its confidence drops below it."""
        B = len(contexts)
        ks = draft_lengths(k, B)
        if tenants is not None and len(tenants) != B:
            raise ValueError(f"propose: {len(tenants)} tenants for {B} contexts")
        floors = [0.0] * B if min_confidence is None else [float(x) for x in min_confidence]
        if len(floors) != B:
            raise ValueError(f"propose: {len(floors)} confidence floors for {B} contexts")
        t0 = time.perf_counter()
        props = [self.propose_row(as_int64(ctx), kb, None if tenants is None else tenants[b], floors[b])
                 for b, (ctx, kb) in enumerate(zip(contexts, ks))]
        width = max(ks, default=0)
        tokens, lengths = pad_drafts([p.tokens for p in props], width)  # (B, max k), (B,)
        conf, _ = pad_drafts([p.confidence for p in props], width, np.float64)  # (B, max k)
        self._proposals += B
        self._propose_seconds += time.perf_counter() - t0
        return torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(conf)

    def propose(self, contexts, k, tenants: Sequence[str | None] | None = None,
                min_confidence: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for every row (`DrafterProtocol.propose`): (tokens (B, max k), lengths (B,))."""
        tokens, lengths, _ = self.propose_scored(contexts, k, tenants, min_confidence)
        return tokens, lengths
