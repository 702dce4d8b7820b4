"""The engine: requests in, committed tokens out, one cycle at a time (vLLM's LLMEngine shape).

`add_request` validates and registers a sequence, `step` runs one cycle for every running row
(rows that run the same chain, draft length and random stream are batched into one executor
call), `abort` drops a row and frees its state. `generate_ids` is the offline loop over these.

Which chain and draft length a row runs is `plan(seq)`; here it is the static choice made at
`add_request` (the adaptive router replaces it).

Context accounting: a request fits when prompt + max_new_tokens <= the context limit (the
smallest of `max_model_len` and the chain's models' contexts; with the router, the pool's). The
draft length takes nothing on top: near the end of the context the executor drafts only what
the room left allows (k shrinks, down to plain decoding for the last token), as it already does
near the end of max_new_tokens. The limit is what users are told (`check_request`'s messages).

Failure isolation (isolation.py): a row whose planning or cycle raises ends alone with
finish_reason "error"; the other rows of its batch are rolled back and rerun alone.

Capacity: with `max_num_seqs` and `max_model_len` given, caches are allocated once and requests
that do not fit raise `CapacityError` (a server queues them); without them, caches are sized to
the batch when no sequence is live (offline use).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrouter.config import MAX_DRAFT_LENGTH, SamplingParams
from specrouter.decoding.executor import ChainExecutor
from specrouter.decoding.sampling import SamplingTensors
from specrouter.engine.faults import ModelFailure, without_failed
from specrouter.engine.faults import logger as fault_logger
from specrouter.engine.isolation import fail_row, run_isolated
from specrouter.engine.stats import CycleStats
from specrouter.errors import (
    ChainError,
    ContextLengthError,
    SamplingParamsError,
    SpecRouterError,
)
from specrouter.models.pool import Pool
from specrouter.router.records import RowContext, RowOutcome
from specrouter.state.manager import StateManager
from specrouter.state.sequence import Sequence


class CapacityError(SpecRouterError):
    """No free cache slot (or not enough positions) for a new request right now."""


@dataclass
class StepOutput:
    """What one step did to one sequence."""

    seq: Sequence  # the row (its .tokens, .done, .finish_reason, .stats are up to date)
    new_token_ids: list[int]  # tokens committed by this step (after stop truncation)


class Engine:
    """Owns the state manager and executor of one pool."""

    def __init__(
        self,
        pool: Pool,
        *,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        router=None,
    ):
        self.pool = pool
        self.router = router  # router.policy.Router: picks chain and k per row every cycle
        self.clock = clock
        self.state = StateManager(pool.runners)
        self.executor = ChainExecutor(pool.runners, pool.drafters, self.state,
                                      pool.vocab_width, clock=clock)
        self._ids = itertools.count()
        self.running: dict[int, Sequence] = {}
        self._plans: dict[int, tuple[tuple[str, ...], int] | None] = {}  # None: the router decides
        self._start: dict[int, float] = {}
        self.fixed_capacity = max_num_seqs is not None and max_model_len is not None
        if self.fixed_capacity:
            for r in pool.runners.values():
                r.reserve(max_num_seqs, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.on_cycle: Callable[[CycleStats], None] | None = None
        self.failed_models: set[str] = set()  # taken out of every chain (faults.py)
        self.on_model_failure: Callable[[ModelFailure], None] | None = None

    # -- requests ---------------------------------------------------------------------------
    def context_limit(self, chain: tuple[str, ...]) -> int:
        lim = min(self.pool.runners[m].max_context for m in chain if m in self.pool.runners)
        return min(lim, self.max_model_len) if self.max_model_len else lim

    def check_request(self, prompt: list[int], params: SamplingParams,
                      chain: tuple[str, ...] | None, k: int) -> tuple[tuple[str, ...], int]:
        """Validate a request without registering it; returns (chain, positions needed); the
        chain is None when the router will choose it."""
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_LENGTH:
            raise ChainError(f"draft length k must be an integer in 1..{MAX_DRAFT_LENGTH}, got {k!r}")
        if chain is None and self.router is not None:
            # the router may pick any chain: check the tightest context of the pool
            checked = tuple(m for m in self.pool.order if m in self.pool.runners)
        else:
            chain = checked = self.pool.validate_chain(
                self.pool.default_chain if chain is None else chain)
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.pool.vocab_width:
            raise ValueError(f"prompt token ids must be in [0, {self.pool.vocab_width})")
        if params.top_k > self.pool.vocab_width:
            raise SamplingParamsError(
                f"top_k must be at most the vocabulary size {self.pool.vocab_width} (0 disables "
                f"it), got {params.top_k}")
        limit = self.context_limit(checked)
        total = len(prompt) + params.max_new_tokens
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the context of {limit} positions (chain "
                f"{checked}) holds at most {limit - 1} prompt tokens and 1 generated: shorten "
                "the prompt")
        if total > limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens and max_new_tokens={params.max_new_tokens}: "
                f"{total} positions, over the context of {limit} (chain {checked}); at most "
                f"{limit - len(prompt)} tokens can be generated after this prompt: lower "
                "max_new_tokens or shorten the prompt")
        return chain, total

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        chain: tuple[str, ...] | None = None,
        k: int = 4,
        generator: torch.Generator | None = None,
    ) -> Sequence:
        """Register a request; it runs from the next `step()`. `generator` (optional) is the
        request's own random stream (seeded requests); rows without one share the engine's."""
        chain, total = self.check_request(prompt, params, chain, k)
        self._ensure_capacity(1, total)
        eos = frozenset() if params.ignore_eos else frozenset(self.pool.eos_ids)
        seq = Sequence(seq_id=next(self._ids), tokens=list(prompt), prompt_len=len(prompt),
                       params=params, stop_ids=eos | frozenset(params.stop_token_ids))
        seq.generator = generator
        self.state.add(seq.seq_id)
        self.running[seq.seq_id] = seq
        self._plans[seq.seq_id] = (chain, k) if chain is not None else None
        self._start[seq.seq_id] = self.clock()
        return seq

    def _ensure_capacity(self, new_rows: int, positions: int) -> None:
        live = len(self.running)
        if self.fixed_capacity and (live + new_rows > self.max_num_seqs or positions > self.max_model_len):
            raise CapacityError(
                f"{live} of {self.max_num_seqs} sequences running; the request needs {positions} "
                f"of at most {self.max_model_len} positions"
            )
        for r in self.pool.runners.values():
            if r.num_slots >= live + new_rows and r.max_len >= positions:
                continue
            if self.fixed_capacity or live:
                raise CapacityError(
                    f"model {r.name!r} has {r.num_slots} slots of {r.max_len} positions, "
                    f"{live} in use; the request needs {positions} positions"
                )
            r.reserve(max(new_rows, r.num_slots), max(positions, 1))

    def reserve(self, num_rows: int, positions: int) -> None:
        """Offline use: size every cache for `num_rows` rows of `positions` positions."""
        if self.running:
            raise RuntimeError("cannot resize caches while sequences are running")
        if not self.fixed_capacity:
            for r in self.pool.runners.values():
                r.reserve(num_rows, positions)

    def abort(self, seq_id: int) -> None:
        """Stop a row now (e.g. its client went away) and free its state."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            seq.done, seq.finish_reason = True, seq.finish_reason or "abort"
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.stats.wall_time = self.clock() - self._start.pop(seq.seq_id, self.clock())
        self._plans.pop(seq.seq_id, None)
        self.state.release(seq.seq_id)
        if self.router is not None:
            self.router.release(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    # -- scheduling -------------------------------------------------------------------------
    def plan(self, seq: Sequence) -> tuple[tuple[str, ...], int]:
        """The chain and draft length this row runs next cycle: pinned at add_request, or the
        router's decision for this cycle (k == 0 for plain decoding)."""
        pinned = self._plans[seq.seq_id]
        if pinned is not None:
            return pinned
        d = self.router.decide(RowContext(seq.seq_id, len(seq.tokens), batch_size=len(self.running),
                                          greedy=seq.params.greedy, remaining=seq.remaining))
        return d.chain, d.k

    def step(self, default_generator: torch.Generator | None = None) -> list[StepOutput]:
        """One cycle for every running row; returns what each row committed. A row whose
        planning or cycle raises ends alone with finish_reason "error" (isolation.py)."""
        groups: dict[tuple, list[Sequence]] = defaultdict(list)
        outputs = []
        for seq in list(self.running.values()):
            try:
                chain, k = self.plan(seq)
            except Exception as e:  # noqa: BLE001 - this row's failure, not the batch's
                fail_row(seq, e)
                outputs.append(self._collect(seq, len(seq.tokens)))
                continue
            groups[(chain, k, id(seq.generator) if seq.generator is not None else None)].append(seq)
        for (chain, k, _), rows in groups.items():
            before = [len(s.tokens) for s in rows]
            gen = rows[0].generator if rows[0].generator is not None else default_generator
            run_isolated(rows, functools.partial(self._run_rows, chain=chain, k=k, gen=gen),
                         self.state)
            outputs += [self._collect(s, b) for s, b in zip(rows, before)]
        return outputs

    def _collect(self, seq: Sequence, before: int) -> StepOutput:
        """The row's output of this step; a finished row leaves the batch."""
        if seq.done:
            self.running.pop(seq.seq_id, None)
            self._finish(seq)
        return StepOutput(seq=seq, new_token_ids=seq.tokens[before:])

    def _run_rows(self, rows: list[Sequence], chain: tuple[str, ...], k: int,
                  gen: torch.Generator | None) -> None:
        """One cycle of `chain` for `rows` (same chain, draft length and random stream)."""
        sampling = SamplingTensors.from_params([s.params for s in rows])
        shadow = self._shadow_proposals(rows, chain) if self.router is not None else None
        # -- fault tolerance (faults.py): a model that raised or timed out is out of every
        # chain; on a failure the rows are rolled back to their committed tokens and the
        # cycle is retried without it (the target failing ends the rows with "error") ----
        stats = None
        while chain is not None:
            chain = without_failed(chain, self.failed_models, self.pool.target)
            try:
                stats = self.executor.cycle(rows, chain, k, sampling, gen)
                break
            except ModelFailure as failure:
                chain = self._on_model_failure(failure, rows, chain, k)
        # -------------------------------------------------------------------------------
        if stats is not None and self.router is not None:
            self._observe(rows, stats, shadow)
        if stats is not None and self.on_cycle is not None:
            self.on_cycle(stats)

    def _on_model_failure(self, failure: ModelFailure, rows: list[Sequence],
                          chain: tuple[str, ...], k: int) -> tuple[str, ...] | None:
        """Take the failed model out (see faults.py's docstring). Returns the chain to retry the
        cycle with, or None when the target failed (the rows are then finished with "error")."""
        model = failure.model
        target = self.pool.target
        # a model failing again after it was taken out (something outside the chain, e.g. a probe,
        # still calls it) ends the rows too: every retry takes a new model out, so retries are bounded
        fatal = model == target or model in self.failed_models
        fault_logger.error(
            "model %r failed (%s) in chain %s for %d row(s): %s%s", model, failure.kind,
            ">".join(chain), len(rows), failure.cause,
            "; the rows finish with finish_reason 'error'" if fatal else "; it is taken out of every chain",
            extra={"model": model, "kind": failure.kind, "chain": ">".join(chain), "rows": len(rows),
                   "seq_ids": [s.seq_id for s in rows]},
        )
        if model != target or failure.kind == "timeout":
            self.failed_models.add(model)
        if self.on_model_failure is not None:
            self.on_model_failure(failure)
        for seq in rows:  # drop speculative tokens, keep the last committed token pending
            self.state.commit(seq.seq_id, seq.tokens, len(seq.tokens))
        if fatal:
            for seq in rows:
                seq.done, seq.finish_reason, seq.error = True, "error", str(failure)
            return None
        new_chain = tuple(m for m in chain if m != model)  # == chain if it failed outside the chain
        for seq in rows:
            if seq.seq_id in self._plans:
                self._plans[seq.seq_id] = (new_chain, k)
        return new_chain

    # -- router feedback ----------------------------------------------------------------------
    def _shadow_proposals(self, rows: list[Sequence], chain: tuple[str, ...]) -> dict:
        """What each model-free drafter would propose for rows that do not run it (free
        evidence of its acceptance for this request: tens of microseconds per row)."""
        out = {}
        for name, drafter in self.pool.drafters.items():
            if chain[0] == name:
                continue
            tokens, lengths = drafter.propose([s.tokens for s in rows], self.router.config.shadow_k)
            out[name] = [t[:m] for t, m in zip(tokens.tolist(), lengths.tolist())]
        return out

    def _observe(self, rows: list[Sequence], stats: CycleStats, shadow: dict | None) -> None:
        outcomes = [
            RowOutcome(seq_id=s.seq_id, chain=stats.chain, k=stats.row_k[b],
                       drafted=stats.row_drafted[b], accepted=stats.row_accepted[b],
                       greedy=s.params.greedy, context_len=stats.row_context[b], tv=stats.row_tv[b])
            for b, s in enumerate(rows)
        ]
        self.router.observe_cycle(stats, outcomes, stats.forwards)
        for name, proposals in (shadow or {}).items():
            for b, s in enumerate(rows):
                committed = s.tokens[stats.row_context[b]:]
                self.router.observe_shadow(s.seq_id, name, proposals[b], committed, self.router.config.shadow_k,
                                           s.params.greedy)
                if stats.row_proposal:  # greedy, a model drafted: how it would judge `name`
                    drafted = stats.row_proposal[b]
                    self.router.observe_shadow(s.seq_id, name, proposals[b], drafted, len(drafted),
                                               True, verifier=stats.chain[0], count_hit=False)

    # -- offline ----------------------------------------------------------------------------
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
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        need = max(self.check_request(p, sp, chain, k)[1] for p, sp in zip(prompts, params))
        if not self.running:
            self.reserve(len(prompts), need)
        seqs = [self.add_request(p, sp, chain=chain, k=k) for p, sp in zip(prompts, params)]
        previous, self.on_cycle = self.on_cycle, on_cycle
        try:
            while any(not s.done for s in seqs):
                self.step(generator)
        finally:
            self.on_cycle = previous
            for s in seqs:
                if not s.done:
                    self.abort(s.seq_id)
        return seqs
