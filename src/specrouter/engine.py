"""The engine: turns prompts into finished sequences by running cycles of the executor.

For now every row runs the chain and draft length it is given (a static chain); the router
(issue "Adaptive router") replaces `_plan` with a per-row decision.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from .config import MAX_DRAFT_LENGTH, SamplingParams
from .errors import ChainError, ContextLengthError
from .executor import ChainExecutor
from .pool import Pool
from .sampling import SamplingTensors
from .sequence import Sequence
from .state import StateManager
from .stats import CycleStats


class Engine:
    """Owns the state manager and executor of one pool."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.state = StateManager(pool.runners)
        self.executor = ChainExecutor(pool.runners, pool.drafters, pool.target, self.state,
                                      pool.vocab_width)
        self._ids = itertools.count()

    def context_limit(self, chain: tuple[str, ...]) -> int:
        return min(self.pool.runners[m].max_context for m in chain if m in self.pool.runners)

    def generate_ids(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        chain: tuple[str, ...] | None = None,
        k: int = 4,
        generator: torch.Generator | None = None,
        on_cycle: Callable[[CycleStats], None] | None = None,
    ) -> list[Sequence]:
        """Generate for every prompt with a static `chain` and draft length `k`."""
        pool = self.pool
        chain = pool.validate_chain(chain or pool.default_chain)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_LENGTH:
            raise ChainError(f"draft length k must be an integer in 1..{MAX_DRAFT_LENGTH}, got {k!r}")
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        limit = self.context_limit(chain)
        need = 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not p:
                raise ValueError(f"prompt {i} is empty: at least one token is needed")
            total = len(p) + sp.max_new_tokens + k + 1
            if total > limit:
                raise ContextLengthError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={sp.max_new_tokens} and "
                    f"draft length {k} it needs {total} positions, over the context of {limit} "
                    f"of the chain {chain}: shorten the prompt or lower max_new_tokens"
                )
            need = max(need, total)
        live = len(self.state.live())
        for m in chain:
            if m in pool.runners:
                r = pool.runners[m]
                if live == 0:
                    r.reserve(len(prompts), need)
                elif r.max_len < need or r.num_slots < live + len(prompts):
                    raise RuntimeError("cannot grow model caches while sequences are live")
        eos = frozenset(pool.eos_ids)
        seqs = [
            Sequence(seq_id=next(self._ids), tokens=list(p), prompt_len=len(p), params=sp,
                     stop_ids=(frozenset() if sp.ignore_eos else eos) | frozenset(sp.stop_token_ids))
            for p, sp in zip(prompts, params)
        ]
        for s in seqs:
            self.state.add(s.seq_id)
        start = time.perf_counter()
        try:
            active = seqs
            while active:
                sampling = SamplingTensors.from_params([s.params for s in active])
                stats = self.executor.cycle(active, chain, k, sampling, generator)
                if on_cycle is not None:
                    on_cycle(stats)
                now = time.perf_counter()
                for s in active:
                    if s.done:
                        s.stats.wall_time = now - start
                        self.state.release(s.seq_id)
                active = [s for s in active if not s.done]
        finally:
            for s in seqs:
                if not s.done:
                    s.done, s.finish_reason = True, "abort"
                    self.state.release(s.seq_id)
        return seqs
