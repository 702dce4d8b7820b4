"""The model-runner interface every pool model implements.

A runner owns a KV cache with `num_slots` independent rows ("slots"); a sequence holds one slot
per model for its whole life. The runner itself keeps NO lengths: each forward says, per row,
how many cached positions are valid (`starts`). Positions >= starts are overwritten by the new
tokens, so rollback is the caller passing a smaller start next time: O(1) and exact
(gpt-fast's "do not advance the position"). The state manager owns the lengths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One ragged forward: row b appends `tokens[b, :num_tokens[b]]` after `starts[b]` cached
    positions of slot `slots[b]`, and asks for logits at `logit_positions[b]` (indices into the
    new tokens, 0 <= i < num_tokens[b]; rows may repeat their last index as padding)."""

    slots: torch.Tensor  # (B,) int64: cache slot of each row
    starts: torch.Tensor  # (B,) int64: valid cached positions of each row before this forward
    tokens: torch.Tensor  # (B, T) int64: new tokens, right-padded (pad value is irrelevant)
    num_tokens: torch.Tensor  # (B,) int64: valid new tokens per row, 1..T
    logit_positions: torch.Tensor  # (B, G) int64: where logits are wanted, indices into T
    # Python mirrors of the small tensors above, so runners can take fast paths without syncs.
    slots_list: list[int]
    starts_list: list[int]
    num_tokens_list: list[int]
    # a token tree (runners whose `supports_trees`): (B, T) int64, each new token's parent among
    # its row's new tokens (< its own index; -1: a child of the cached prefix); None: every row
    # is a chain (parents t - 1). A node's RoPE position is start + its depth, it is cached at
    # start + its index, and it attends the prefix and its own ancestors: its logits are those
    # of sequential decoding of its path (docs/trees.md)
    parents: torch.Tensor | None = None

    def to(self, device: torch.device) -> "ForwardBatch":
        """The batch with its tensors on `device` (itself when they are there): host-to-device
        copies only, no sync; the Python mirrors stay as they are."""
        if self.tokens.device == device:
            return self
        import dataclasses

        names = ("slots", "starts", "tokens", "num_tokens", "logit_positions") + (
            ("parents",) if self.parents is not None else ())
        parts = [getattr(self, n) for n in names]
        if any(p.device != parts[0].device or p.dtype != parts[0].dtype for p in parts):
            return dataclasses.replace(self, **{n: p.to(device, non_blocking=True) for n, p in zip(names, parts)})
        # one host-to-device copy for the small tensors, not one each (each copy is a launch and
        # a driver call: on a GPU they cost more than a graphed step of a small model)
        flat = torch.cat([p.reshape(-1) for p in parts]).to(device, non_blocking=True)
        views = torch.split(flat, [p.numel() for p in parts])
        return dataclasses.replace(self, **{n: v.view(p.shape) for n, v, p in zip(names, views, parts)})

    @staticmethod
    def build(
        slots: list[int],
        starts: list[int],
        new_tokens: list[list[int]],
        logit_positions: list[list[int]],
        device: torch.device | str = "cpu",
        parents: list[list[int]] | None = None,
    ) -> "ForwardBatch":
        """Pad ragged Python lists into a batch. `logit_positions[b]` may be shorter than the
        longest; it is padded by repeating its last index. `parents[b]` (one per new token):
        a token tree (see `ForwardBatch.parents`)."""
        B = len(slots)
        assert B == len(starts) == len(new_tokens) == len(logit_positions) and B > 0
        num = [len(t) for t in new_tokens]
        npos = [len(g) for g in logit_positions]
        assert min(num) >= 1 and min(npos) >= 1, "every row feeds a token and wants a logit"
        # ONE tensor construction for the small tensors and the padded rows (views into it): a
        # torch.tensor call and a pad cost 5-10 us each on a CPU, the executor builds 2-6
        # batches a step, and rows are few (Python padding of short rows is cheaper)
        T, G = max(num), max(npos)
        flat = [*slots, *starts, *num]
        for row, n in zip(new_tokens, num):
            flat += row
            if n < T:
                flat += [0] * (T - n)
        for row, n in zip(logit_positions, npos):
            flat += row
            if n < G:
                flat += [row[-1]] * (G - n)  # padding repeats the last index
        if parents is not None:
            for row, n in zip(parents, num):
                flat += row
                if n < T:
                    flat += [-1] * (T - n)
        buf = torch.tensor(flat, dtype=torch.long)
        if device != "cpu" and torch.device(device).type != "cpu":
            buf = buf.to(device)
        parts = buf.split([B, B, B, B * T, B * G] + ([B * T] if parents is not None else []))
        return ForwardBatch(
            slots=parts[0],
            starts=parts[1],
            tokens=parts[3].view(B, T),
            num_tokens=parts[2],
            logit_positions=parts[4].view(B, G),
            slots_list=list(slots),
            starts_list=list(starts),
            num_tokens_list=num,
            parents=None if parents is None else parts[5].view(B, T),
        )


class ModelRunner(ABC):
    """A causal LM with a slot-addressed KV cache. See the module docstring for the contract."""

    name: str  # pool name of the model
    vocab_size: int  # logits width (tokenizer vocabularies are checked by the pool)
    max_len: int  # the longest sequence (prompt + generated + draft) a slot can hold now
    max_context: int  # the model's own limit (max_position_embeddings)
    num_slots: int  # concurrent sequences the cache holds
    num_params: int  # parameter count (for display and cost priors)
    dtype: torch.dtype  # compute dtype
    device: torch.device
    # a ragged forward costs its valid tokens (packed), not rows x the widest row (padded): the
    # cost of a forward is then a function of the mean width, which the router predicts from
    packs_ragged: bool = False
    # runs token trees (`ForwardBatch.parents`) and moves an accepted branch (`move_kv`)
    supports_trees: bool = False
    # a forward's bits do not depend on torch's thread count (every op on the native row-invariant
    # kernels, which give each output to one thread): the offline loops and the server run fewer
    # threads under a co-tenant only where every model says so (engine/contention.py)
    thread_invariant: bool = False

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the new tokens of every row; return logits (B, G, vocab_size) at
        `batch.logit_positions`, in float32 (float64 if the model computes in float64).

        Precondition: slot `slots[b]` holds the KV of the row's first `starts[b]` tokens, as
        written by earlier forwards. Postcondition: it holds `starts[b] + num_tokens[b]`."""

    def _free_list(self) -> list[int]:
        # rebuilt when reserve() changed num_slots (only done while no slot is in use)
        if getattr(self, "_slot_capacity", None) != self.num_slots:
            self._free_slots = list(range(self.num_slots - 1, -1, -1))
            self._free_set = set(self._free_slots)
            self._slot_capacity = self.num_slots
        return self._free_slots

    # -- prefix caching (state/prefix_cache.py) ----------------------------------------------
    # A prefix cache parks finished sequences' slots (still "in use" here) and registers itself
    # as `parking` = (cache, pool name). A slot request that finds no free slot makes it give
    # one back first: running requests always take precedence over parked KV, whichever engine
    # parked it. `generation` counts reallocations: parked KV of an older one is never adopted.
    parking: tuple | None = None
    generation: int = 0

    def reallocating(self) -> None:
        """Call in `reserve` before the cache is reallocated (or its contents dropped): parked
        slots go back to the free list and the generation moves on."""
        if self.parking is not None:
            cache, name = self.parking
            cache.drop_model(name)
        self.generation += 1

    def kv_bytes_per_position(self) -> int:
        """Bytes of cache one position of one slot holds (0 when unknown, e.g. grown on demand)."""
        return 0

    def move_kv(self, slot: int, start: int, nodes: list[int]) -> None:
        """After a token tree's verification: the KV of the nodes cached at `start + nodes[i]`
        (an accepted branch, root first, increasing indices) moves to `start + i`, so the branch
        sits at contiguous positions like a chain's; what else the tree left past it is garbage
        (overwritten by the next forward). Runners that run trees implement it."""
        raise NotImplementedError(f"model {self.name!r} runs no token trees")

    def slot_bytes(self, slot: int) -> int:
        """Bytes of cache that slot `slot` keeps alive (what parking it costs): its whole
        allocation on a preallocated cache; a runner whose caches grow on demand counts what the
        slot holds now."""
        return self.kv_bytes_per_position() * self.max_len

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the KV of positions [0, length) of slot `src` into slot `dst` (a prefix cache
        hit shared by a running sequence). Runners that cannot raise NotImplementedError."""
        raise NotImplementedError(f"model {self.name!r} cannot copy cache slots")

    def allocate_slot(self) -> int:
        """Reserve a free cache slot, reclaiming a parked one if none is free; raises
        RuntimeError when all are taken by running sequences."""
        free = self._free_list()
        while not free and self.parking is not None and self.parking[0].reclaim(self.parking[1]):
            free = self._free_list()
        if not free:
            raise RuntimeError(f"model {self.name!r}: all {self.num_slots} cache slots are in use")
        slot = free.pop()
        self._free_set.discard(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """Return a slot to the free list (its contents become garbage)."""
        free = self._free_list()
        if not 0 <= slot < self.num_slots or slot in self._free_set:
            raise RuntimeError(f"model {self.name!r}: slot {slot} is not in use")
        free.append(slot)
        self._free_set.add(slot)
        self.on_slot_freed(slot)

    def on_slot_freed(self, slot: int) -> None:
        """Hook for runners holding per-slot objects (the transformers fallback)."""

    @abstractmethod
    def reserve(self, num_slots: int, max_len: int) -> None:
        """Make the cache hold at least `num_slots` slots of `max_len` positions each. May
        reallocate (contents are lost): call only when no sequence is live. Raises
        ContextLengthError if max_len exceeds the model's `max_context`."""
