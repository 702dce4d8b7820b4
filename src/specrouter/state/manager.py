"""Synchronized state management (docs/design.md pillar 3).

Every (model, sequence) pair has a `ModelState`: the model's cache slot and how many of the
sequence's committed tokens its KV cache holds (`cache_len`). Tokens a model has not seen yet
(`tokens[cache_len:]`, the *pending* tokens) are fed to it at the start of its next forward:
that is the catch-up of a lagging model, and also the prefill of a new sequence.

During a cycle a model also caches *speculative* tokens (drafts and candidates) past the
committed ones. At commit, each model keeps the longest prefix of its speculative tokens that
the target committed, and drops the rest: rollback is an integer assignment, O(1) and exact,
because runners overwrite every position >= the start they are given (see runners/base.py).

Invariant (tested): for every live model state, `cache_len < len(tokens)` (at least the last
committed token is pending, so the next forward yields the next-token distribution), and the
runner's cache positions [0, cache_len) equal a fresh prefill of `tokens[:cache_len]`.

With a draft head in the pool, the manager also keeps each row's target features
(`features`, a `FeatureStore` by target slot): the target's `ModelState.features` counts the
positions stored, valid up to its `cache_len` (state/features.py), so every rollback of the
target's cache is a rollback of its features too. A head's own state is a plain `ModelState`
whose cache mirrors the target's positions (decoding/head_drafting.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrouter.models.runners.base import ModelRunner
from specrouter.state.features import FeatureStore
from specrouter.state.sequence import common_prefix_len


@dataclass
class ModelState:
    """One model's view of one sequence."""

    slot: int  # cache slot of this sequence in the model's runner
    cache_len: int = 0  # committed tokens whose KV is valid in the cache
    speculative: list[int] = field(default_factory=list)  # uncommitted tokens cached after them
    features: int = 0  # the target's state: leading positions in the feature store (valid: < cache_len)


class StateManager:
    """Owns every ModelState of every live sequence for one pool of runners.

    Sequences are identified by an integer id; `tokens` (the committed token list) is owned by
    the caller and passed in, so the manager never copies it.
    """

    def __init__(self, runners: dict[str, ModelRunner], features: FeatureStore | None = None):
        self.runners = runners
        self.features = features  # the target's features by target slot (a pool with a head)
        self._states: dict[int, dict[str, ModelState]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        if seq_id in self._states:
            raise KeyError(f"sequence {seq_id} is already live")
        self._states[seq_id] = {}

    def state(self, seq_id: int, model: str) -> ModelState:
        """The model's state for the sequence; its cache slot is allocated on first use."""
        states = self._states[seq_id]
        st = states.get(model)
        if st is None:
            st = states[model] = ModelState(slot=self.runners[model].allocate_slot())
        return st

    def adopt(self, seq_id: int, model: str, slot: int, cache_len: int, *, features: int = 0,
              source: int | None = None) -> None:
        """Start the model's state on a slot already holding the KV of the sequence's first
        `cache_len` tokens (a prefix cache hit, state/prefix_cache.py). The target's first
        `features` features are in this manager's store at slot `source` (copied when the slot
        differs); without a store holding them, features restart at 0 (a head re-feeds)."""
        states = self._states[seq_id]
        assert model not in states, "a prefix is adopted before the model's first use"
        store = self.features
        if store is None or source is None or max(slot, source) >= store.buffer.shape[0] \
                or features > store.buffer.shape[1]:
            features = 0
        elif features and source != slot:
            store.buffer[slot, :features] = store.buffer[source, :features]  # (features, H)
        states[model] = ModelState(slot=slot, cache_len=cache_len, features=features)

    def detach(self, seq_id: int) -> dict[str, ModelState]:
        """Remove the sequence and hand its states (and slots) to the caller (a prefix cache)."""
        return self._states.pop(seq_id, {})

    def release(self, seq_id: int) -> None:
        """Free every cache slot the sequence holds."""
        for model, st in self._states.pop(seq_id, {}).items():
            self.runners[model].free_slot(st.slot)

    def live(self) -> list[int]:
        return list(self._states)

    def states_of(self, seq_id: int) -> dict[str, ModelState]:
        return self._states[seq_id]

    # -- one cycle -------------------------------------------------------------------------
    @staticmethod
    def fed(st: ModelState, tokens: list[int], speculative: list[int]) -> None:
        """Record a forward that fed all pending tokens plus `speculative` ones."""
        assert not st.speculative, "a model is fed once per cycle; commit in between"
        st.cache_len = len(tokens)
        st.speculative = speculative

    def commit(self, seq_id: int, tokens: list[int], num_committed_before: int) -> None:
        """`tokens` now holds the newly committed tokens after position `num_committed_before`.
        Every model keeps the prefix of its speculative tokens that was committed (at most up
        to the last committed token, which stays pending) and drops the rest."""
        new = tokens[num_committed_before:]
        limit = len(tokens) - 1
        for st in self._states[seq_id].values():
            spec = st.speculative
            if spec:
                keep = common_prefix_len(spec, new)
                st.cache_len = min(num_committed_before + keep, limit)
                st.speculative = []
            elif st.cache_len > limit:
                st.cache_len = limit

    @staticmethod
    def rollback(st: ModelState, length: int) -> None:
        """Forget everything past `length` committed tokens: O(1)."""
        st.cache_len = min(st.cache_len, length)
        st.speculative = []
