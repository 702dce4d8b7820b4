"""Prefix caching: a request that starts like an earlier one skips the work already done, in
every model of the chain, bit for bit.

A finished sequence's cache slots are not freed but *parked*: an `Entry` remembers its tokens,
its tenant, and for every model the slot and how many leading positions hold valid KV. A new
request *adopts* the entry sharing the longest prefix with its prompt (at most prompt length
- 1: the last prompt token is always fed, so the first forward yields the next-token
distribution): each model's state starts at `cache_len = n` instead of 0, and the engine only
feeds the rest. Because the runners' kernels are row-invariant (a position's KV does not depend
on how it was batched or chunked), the adopted KV is bitwise the KV a prefill would compute, so
outputs are identical with the cache on or off (tests/test_prefix_cache.py checks both).

Adopting takes the entry's slots when the new request subsumes it (a multi-turn conversation:
the next turn re-sends the whole history) or when no other slot can be had; otherwise it copies
the shared prefix into fresh slots (`ModelRunner.copy_slot`, a few ms; a full cache gives up its
least recently used other entry for it) and the entry stays for the next request (a shared
system prompt). Parking a sequence drops the entries it subsumes.

Index: entries are few (bounded by the parked-slot budget, tens), so the longest common prefix
is a vectorized scan over them (numpy, ~2 us per entry of 2,000 tokens); a token radix tree or
hashed blocks pay off when KV is paged into shared blocks, which the slot caches are not.

Safety, by construction:
- scope: an entry is only visible to requests of its own tenant (the engine passes (engine id,
  API-key tenant or None): engines over views of one pool never adopt each other's entries);
- budget: parked KV (every parked slot's whole allocation) stays under `budget_bytes`, and at
  most `max_slots` sequences are parked; the least recently used entries are evicted first;
- precedence: a runner that has no free slot for a running request reclaims parked slots
  (`ModelRunner.allocate_slot` calls `reclaim`), whichever engine parked them, since the cache
  belongs to the runners (`PrefixCache.of`), not to an engine;
- reallocation: a runner's `reserve` calls `reallocating()` first, which drops its parked
  slots and bumps its `generation`; a part parked under an older generation is never adopted.
- draft heads: the target's features (state/features.py, kept per engine by target slot) are
  parked with the target's slot (`Parked.features`) and adopted with it (copied with a copy);
  a head's own KV (one layer) is parked like a model's, and adopted one position short of the
  others (its position p read token p + 1), so its catch-up forward feeds only the new
  positions (on the 135M target's shipped head, a 330-token catch-up cost 11.7 ms against
  2.0 ms for a 4-token one).
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass, field

import numpy as np

from specrouter.models.runners.base import ModelRunner

MAX_PARKED_SLOTS = 32  # sequences parked at most (extra cache slots per runner)


def default_budget_bytes() -> int:
    """The default parked-KV budget: a tenth of the machine's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(total // 10, 4 << 30))


def base_runner(r):
    """The runner under any wrappers (a server's `GuardedRunner`, a `GraphedRunner`): the cache
    registers on, parks in and copies within the object that owns the slots (its free list)."""
    while True:
        d = vars(r)
        inner = d.get("inner", d.get("runner") if not isinstance(r, ModelRunner) else None)
        if inner is None:
            return r
        r = inner


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int64 token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Parked:
    """One model's part of an entry."""

    slot: int  # the runner's cache slot (kept "in use" while parked)
    length: int  # leading positions of the entry's tokens whose KV the slot holds
    generation: int  # the runner's allocation generation when parked
    features: int = 0  # the target's part: leading positions whose features the engine's store holds


@dataclass(eq=False)  # compared by identity
class Entry:
    tokens: np.ndarray  # (L,) int64: the tokens whose KV is parked
    tenant: object  # whose requests may adopt it (the engine's key: (engine, API-key tenant))
    parts: dict[str, Parked]  # by pool model name
    last_used: int = 0  # LRU clock


@dataclass
class PrefixCacheStats:
    """Counters for /metrics and the bench (cumulative)."""

    lookups: int = 0  # requests that looked for a cached prefix
    hits: int = 0  # ... and adopted one (>= 1 token)
    prompt_tokens: int = 0  # prompt tokens of the lookups
    cached_tokens: int = 0  # prompt tokens the target did not recompute
    evictions: int = 0  # entries dropped for the budget, for a running request, or a reallocation
    copies: int = 0  # hits that copied the prefix (the entry stayed)
    moves: int = 0  # hits that took the entry's slots


@dataclass
class Adoption:
    """What a request adopted at admission."""

    cached_tokens: int  # the target's adopted length (the prompt tokens it skips)
    lengths: dict[str, int] = field(default_factory=dict)  # every adopted model's cache_len


class PrefixCache:
    """Parked slots of the runners of one pool, shared by every engine over those runners."""

    def __init__(self, runners: dict[str, ModelRunner], budget_bytes: int | None = None):
        runners = {n: base_runner(r) for n, r in runners.items()}
        # weak: the runners hold the cache (`parking`); no cycle keeps a dropped pool's memory
        self.runners = weakref.WeakValueDictionary(runners)
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else int(budget_bytes)
        self.entries: list[Entry] = []
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)
        self._pinned: Entry | None = None  # the entry being adopted (not reclaimable meanwhile)
        for name, r in runners.items():
            r.parking = (self, name)

    @classmethod
    def of(cls, runners: dict[str, ModelRunner], budget_bytes: int | None = None) -> "PrefixCache":
        """The cache registered on these runners (created on first use): one per set of runners,
        so engines over views of one pool share it. A given budget replaces the current one."""
        runners = {n: base_runner(r) for n, r in runners.items()}
        for r in runners.values():
            if r.parking is not None:
                cache = r.parking[0]
                for n, runner in runners.items():  # a view may name a runner the cache has not seen
                    if runner.parking is not None and runner.parking[0] is cache:
                        cache.runners[n] = runner
                if budget_bytes is not None:
                    cache.budget_bytes = int(budget_bytes)
                    cache._enforce()
                return cache
        return cls(runners, budget_bytes)

    # -- sizing ------------------------------------------------------------------------------
    def slot_bytes(self, name: str, slot: int = 0) -> int:
        """Bytes parking slot `slot` of model `name` keeps alive (`ModelRunner.slot_bytes`: the
        whole allocation of a preallocated cache, what a grown one holds now)."""
        return self.runners[name].slot_bytes(slot)

    def entry_bytes(self, e: Entry) -> int:
        return sum(self.slot_bytes(m, p.slot) for m, p in e.parts.items())

    @property
    def parked_bytes(self) -> int:
        return sum(self.entry_bytes(e) for e in self.entries)

    def extra_slots(self, max_len: int) -> int:
        """Slots to reserve beside the running ones so that the budget can be used: the budget
        over one sequence's KV in every parkable model at `max_len` positions."""
        per = sum(r.kv_bytes_per_position() * max_len for r in list(self.runners.values())
                  if r.parking is not None)
        if self.budget_bytes <= 0:
            return 0
        return MAX_PARKED_SLOTS if per == 0 else int(min(MAX_PARKED_SLOTS, self.budget_bytes // per))

    # -- park / adopt ------------------------------------------------------------------------
    def park(self, tokens: list[int], tenant, states: dict) -> None:
        """Take over a finished sequence's slots (`states`: model name -> ModelState, detached
        from its state manager): parked if they hold KV, freed otherwise."""
        parts = {}
        for model, st in states.items():
            r = self.runners[model]
            if r.parking is None or st.cache_len <= 0 or st.speculative:  # mid-cycle: not committed
                r.free_slot(st.slot)
            else:
                parts[model] = Parked(st.slot, st.cache_len, r.generation, min(st.features, st.cache_len))
        if not parts:
            return
        length = max(p.length for p in parts.values())
        new = Entry(np.asarray(tokens[:length], dtype=np.int64), tenant, parts, next(self._clock))
        for e in list(self.entries):  # an exact repeat: keep the one parked earlier
            if e.tenant == tenant and self._covers(e, new):
                e.last_used = new.last_used
                self._free(new)
                return
        for e in list(self.entries):  # the new one continues an older one (multi-turn)
            if e.tenant == tenant and self._covers(new, e):
                self._drop(e, evicted=False)
        self.entries.append(new)
        self._enforce()

    def adopt(self, seq_id: int, prompt: list[int], tenant, manager,
              target: str) -> Adoption:
        """Give sequence `seq_id` (just added to `manager`, no state yet) the longest cached
        prefix of `prompt`, at most len(prompt) - 1 tokens, in every model of the entry."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        query = np.asarray(prompt, dtype=np.int64)
        best, best_n, best_lcp = None, 0, 0
        for e in self.entries:
            if e.tenant != tenant:
                continue
            lcp = common_prefix(e.tokens, query)
            n = min(lcp, len(prompt) - 1)
            if n > best_n:
                best, best_n, best_lcp = e, n, lcp
        if best is None:
            return Adoption(0)
        take = best_lcp == len(best.tokens)  # the prompt continues the entry: it has no other use
        out = Adoption(0)
        self._pinned = best
        try:
            for model, part in list(best.parts.items()):
                r = self.runners[model]
                if part.generation != r.generation:  # reallocated since: never adopt
                    del best.parts[model]
                    continue
                # a head's position p read token p + 1 (its step at p sees the target's feature
                # of p with the next token): p is shared with the prompt only below best_n - 1
                n = min(best_n - 1 if getattr(r, "is_head", False) else best_n, part.length)
                slot = None if take else self._copy(r, part, n)
                source = part.slot  # where the features are (the engine's store, by target slot)
                if slot is None:  # take the parked slot itself
                    slot = part.slot
                    del best.parts[model]
                manager.adopt(seq_id, model, slot, n, features=min(part.features, n), source=source)
                out.lengths[model] = n
        finally:
            self._pinned = None
        if not best.parts:
            self.entries.remove(best)
            self.stats.moves += 1
        else:
            best.last_used = next(self._clock)
            self.stats.copies += 1
        out.cached_tokens = out.lengths.get(target, 0)
        if out.lengths:
            self.stats.hits += 1
            self.stats.cached_tokens += out.cached_tokens
        return out

    def _copy(self, r: ModelRunner, part: Parked, n: int) -> int | None:
        """A fresh slot holding the part's first n positions (evicting the least recently used
        other entry if no slot is free: the one in use is the most recent), or None (every other
        slot runs a sequence, or a runner that cannot copy)."""
        try:
            slot = r.allocate_slot()
        except RuntimeError:
            return None
        try:
            r.copy_slot(part.slot, slot, n)
        except NotImplementedError:
            r.free_slot(slot)
            return None
        return slot

    # -- eviction ----------------------------------------------------------------------------
    def reclaim(self, model: str) -> bool:
        """Free the least recently used parked slot of `model` (a running request needs one)."""
        cands = [e for e in self.entries if model in e.parts and e is not self._pinned]
        if not cands:
            return False
        self._drop(min(cands, key=lambda e: e.last_used))
        return True

    def drop_model(self, model: str) -> None:
        """Forget every part parked in `model`'s runner (it is about to reallocate)."""
        for e in list(self.entries):
            part = e.parts.pop(model, None)
            if part is not None:
                self.runners[model].free_slot(part.slot)
                if not e.parts:
                    self.entries.remove(e)
                    self.stats.evictions += 1

    def forget(self, scope) -> None:
        """Free the entries of one engine (`Engine.cache_scope`: entries are keyed (scope, tenant))."""
        for e in [e for e in self.entries if isinstance(e.tenant, tuple) and e.tenant[0] == scope]:
            self._drop(e, evicted=False)

    def clear(self) -> None:
        for e in list(self.entries):
            self._drop(e)

    def _enforce(self) -> None:
        while self.entries and (len(self.entries) > MAX_PARKED_SLOTS
                                or self.parked_bytes > self.budget_bytes):
            self._drop(min(self.entries, key=lambda e: e.last_used))

    def _drop(self, e: Entry, evicted: bool = True) -> None:
        self.entries.remove(e)
        self._free(e)
        self.stats.evictions += evicted

    def _free(self, e: Entry) -> None:
        for model, part in e.parts.items():
            r = self.runners[model]
            if part.generation == r.generation:  # else the slot went with the old allocation
                r.free_slot(part.slot)

    @staticmethod
    def _covers(a: Entry, b: Entry) -> bool:
        """Whether entry `a` makes `b` useless: b's tokens are a prefix of a's, and a holds at
        least as many positions as b in each of b's models."""
        if len(b.tokens) > len(a.tokens) or common_prefix(a.tokens, b.tokens) < len(b.tokens):
            return False
        return all(m in a.parts and a.parts[m].length >= p.length for m, p in b.parts.items())
