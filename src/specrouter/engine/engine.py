"""The engine: requests in, committed tokens out, one cycle at a time (vLLM's LLMEngine shape).

`add_request` validates and registers a sequence, `step` runs one cycle for every running row
(one executor step: every model runs one forward over all rows that need it, whatever chain
and draft length each row runs), `abort` drops a row and frees its state. `generate_ids` is the
offline loop over these.

Randomness is counter-based (decoding/noise.py): a row samples position i with noise keyed by
(its seed, i). A request's seed is `SamplingParams.seed`, else one drawn at `add_request` from
the given generator or the engine's own (`self.rng`), so the output of a seeded request is a
function of the request alone: the same at every run, concurrency and router decision, and
equal to plain decoding of the target with that seed.

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

Prefix caching (state/prefix_cache.py, on unless `prefix_cache=False`): a finished (or aborted)
row's slots are parked at `_finish`, and `add_request` adopts the longest cached prefix of the
prompt (same engine, same tenant) in every model; engines over views of one pool share the
cache's slots (any may reclaim them) but never read each other's entries (side-by-side
comparisons stay honest). A server's caches hold up to `max_num_seqs` more slots for parked
rows (within the budget: `PrefixCache.extra_slots`); offline, parked rows use the slots left
free, and reservations round positions up (a power of two) so that a growing conversation does
not reallocate (which drops parked slots) at every turn.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrouter.config import MAX_DRAFT_LENGTH, SamplingParams
from specrouter.drafters.base import as_int64
from specrouter.decoding.executor import ChainExecutor, StepResult
from specrouter.decoding.noise import seed_key
from specrouter.decoding.sampling import SamplingTensors
from specrouter.engine.faults import ModelFailure, without_failed
from specrouter.engine.faults import logger as fault_logger
from specrouter.engine.isolation import fail_row, run_isolated
from specrouter.records.stats import CycleStats
from specrouter.errors import (
    ChainError,
    ContextLengthError,
    SamplingParamsError,
    SpecRouterError,
)
from specrouter.models.pool import Pool
from specrouter.records.routing import RowContext
from specrouter.state.manager import StateManager
from specrouter.state.prefix_cache import PrefixCache
from specrouter.state.sequence import Sequence


def _feature_store(pool: Pool):
    """The target's features by slot when the pool has a draft head (state/features.py)."""
    if not getattr(pool, "heads", None):
        return None
    from specrouter.state.features import FeatureStore

    target = pool.runners[pool.target]
    return FeatureStore(target.arch.hidden_size, target.dtype, target.device)


_ENGINE_IDS = itertools.count()


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
        prefix_cache: bool = True,
        kv_cache_bytes: int | None = None,
    ):
        self.pool = pool
        # parked KV of finished rows, shared by every engine over these runners (None: off)
        self.prefix_cache = PrefixCache.of(pool.runners, kv_cache_bytes) if prefix_cache else None
        self.cache_scope = next(_ENGINE_IDS)  # prefix-cache entries are keyed (cache_scope, tenant)
        self.router = router  # router.policy.Router: picks chain and k per row every cycle
        self.clock = clock
        self.state = StateManager(pool.runners, features=_feature_store(pool))
        self.executor = ChainExecutor(pool.runners, pool.drafters, self.state,
                                      pool.vocab_width, order=list(pool.order), clock=clock)
        self.rng = torch.Generator()  # seeds of requests without one (AsyncEngine reseeds it)
        self.rng.manual_seed(torch.seed())
        self._ids = itertools.count()
        self.running: dict[int, Sequence] = {}
        self._plans: dict[int, tuple[tuple[str, ...], int] | None] = {}  # None: the router decides
        self._floors: dict[int, float] = {}  # the router's Decision.min_confidence of each row's plan
        self._peek_at: dict[int, int] = {}  # a row's next confident-draft check (router steps)
        self._start: dict[int, float] = {}
        self.fixed_capacity = max_num_seqs is not None and max_model_len is not None
        if self.fixed_capacity:
            for r in pool.runners.values():
                r.reserve(max_num_seqs + self._parked_slots(max_num_seqs, max_model_len), max_model_len)
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
        tenant: str | None = None,
    ) -> Sequence:
        """Register a request; it runs from the next `step()`. Its sampling seed is
        `params.seed`, else drawn from `generator` (or the engine's `rng`). `tenant` keeps a
        learning drafter's statistics apart (None: the shared ones)."""
        chain, total = self.check_request(prompt, params, chain, k)
        self._ensure_capacity(1, total)
        eos = frozenset() if params.ignore_eos else frozenset(self.pool.eos_ids)
        seq = Sequence(seq_id=next(self._ids), tokens=list(prompt), prompt_len=len(prompt),
                       params=params, stop_ids=eos | frozenset(params.stop_token_ids))
        seq.tenant = tenant
        if params.seed is not None:
            seed = params.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator or self.rng))
        seq.seed_key = seed_key(seed)
        self.state.add(seq.seq_id)
        if self.prefix_cache is not None:
            seq.stats.cached_tokens = self.prefix_cache.adopt(
                seq.seq_id, seq.tokens, (self.cache_scope, tenant), self.state, self.pool.target).cached_tokens
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

    def _parked_slots(self, rows: int, positions: int) -> int:
        """Slots for parked sequences beside `rows` running ones (at most as many: memory)."""
        return 0 if self.prefix_cache is None else min(rows, self.prefix_cache.extra_slots(positions))

    ROUND_ROWS = 8  # offline reservations of at most this many rows round positions up (reserve)

    def reserve(self, num_rows: int, positions: int) -> None:
        """Offline use: size every cache for `num_rows` rows of `positions` positions (with the
        prefix cache and at most ROUND_ROWS rows: positions rounded up to a power of two >= 256
        within the models' contexts, so that a growing conversation does not reallocate every
        turn; never for big batches, whose memory it would multiply; parked sequences use the
        slots left free, and give them back to running ones)."""
        if self.running:
            raise RuntimeError("cannot resize caches while sequences are running")
        if not self.fixed_capacity:
            if self.prefix_cache is not None and num_rows <= self.ROUND_ROWS:
                positions = max(positions, min(max(256, 1 << (positions - 1).bit_length()),
                                               self.context_limit(tuple(self.pool.runners))))
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
        if seq.finish_reason != "error":  # learning drafters (suffix) see every finished request
            for drafter in self.pool.drafters.values():
                observe = getattr(drafter, "observe_request", None)
                if observe is not None:
                    observe(seq.tokens, seq.tenant)
        self._plans.pop(seq.seq_id, None)
        self._floors.pop(seq.seq_id, None)
        self._peek_at.pop(seq.seq_id, None)
        if self.prefix_cache is not None and seq.finish_reason != "error":
            self.prefix_cache.park(seq.tokens, (self.cache_scope, seq.tenant), self.state.detach(seq.seq_id))
        else:
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
        self._floors[seq.seq_id] = d.min_confidence
        return d.chain, d.k

    def step(self) -> list[StepOutput]:
        """One cycle for every running row: one executor step, every model at most one forward
        over all rows that need it; returns what each row committed. A row whose planning or
        cycle raises ends alone with finish_reason "error" (isolation.py). Randomness is
        counter-based (decoding/noise.py): keyed by each row's seed and position."""
        rows = list(self.running.values())
        if not rows:
            return []
        outputs = []
        try:
            plans = self._plan_step(rows)
        except Exception:  # noqa: BLE001 - find the rows whose planning fails alone
            plans, ok = [], []
            for seq in rows:
                try:
                    plans.append(self._plan_step([seq])[0])
                    ok.append(seq)
                except Exception as e:  # noqa: BLE001 - this row's failure, not the batch's
                    fail_row(seq, e)
                    outputs.append(self._collect(seq, len(seq.tokens)))
            rows = ok
        if rows:
            before = [len(s.tokens) for s in rows]
            plan_of = {s.seq_id: p for s, p in zip(rows, plans)}
            run_isolated(rows, lambda part: self._run_rows(part, [plan_of[s.seq_id] for s in part]),
                         self.state, self._report)
            outputs += [self._collect(s, b) for s, b in zip(rows, before)]
        return outputs

    def _collect(self, seq: Sequence, before: int) -> StepOutput:
        """The row's output of this step; a finished row leaves the batch."""
        if len(seq.tokens) > before and not seq.stats.first_token_time and seq.seq_id in self._start:
            seq.stats.first_token_time = self.clock() - self._start[seq.seq_id]
        if seq.done:
            self.running.pop(seq.seq_id, None)
            self._finish(seq)
        return StepOutput(seq=seq, new_token_ids=seq.tokens[before:])

    def _run_rows(self, rows: list[Sequence], plans: list[tuple[tuple[str, ...], int]]
                  ) -> tuple[StepResult | None, dict | None]:
        """One executor step over `rows`, row b running `plans[b]`: its result (None when the
        target failed and the rows ended) and the shadow proposals made before it."""
        sampling = SamplingTensors.from_params([s.params for s in rows], device=self.pool.device)
        shadow = self._shadow_proposals(rows, plans) if self._shadow_due() else None
        # -- fault tolerance (faults.py): a model that raised or timed out is out of every
        # chain; on a failure the rows are rolled back to their committed tokens and the step
        # is retried without it (the target failing ends the rows with "error") -------------
        result = None
        while True:
            plans = [(without_failed(c, self.failed_models, self.pool.target), k) for c, k in plans]
            try:
                result = self.executor.step(rows, plans, sampling, [self._floors.get(s.seq_id, 0.0) for s in rows])
                break
            except ModelFailure as failure:
                if not self._on_step_failure(failure, rows, plans):
                    break
        # -------------------------------------------------------------------------------------
        return result, shadow

    def _report(self, rows: list[Sequence], ran: tuple[StepResult | None, dict | None]) -> None:
        """A committed step told to the router and `on_cycle` (once: isolation.py)."""
        result, shadow = ran
        if result is None:
            return
        if self.router is not None:
            self._observe(rows, result, shadow)
        if self.on_cycle is not None:
            for stats in result.cycles:
                self.on_cycle(stats)

    def _plan_step(self, rows: list[Sequence]) -> list[tuple[tuple[str, ...], int]]:
        """Every row's (chain, k) for this step: pinned ones as pinned, the router's for the
        others (planned jointly, for the batch this step really runs)."""
        plans: list = [self.plan(s) if self._plans[s.seq_id] is not None else None for s in rows]
        free = [i for i, p in enumerate(plans) if p is None]
        if free:
            contexts = [RowContext(rows[i].seq_id, len(rows[i].tokens), batch_size=len(rows),
                                   greedy=rows[i].params.greedy, remaining=rows[i].remaining) for i in free]
            pinned = [p for p in plans if p is not None]
            plan_batch = getattr(self.router, "plan_batch", None)
            decisions = (plan_batch(contexts, pinned) if plan_batch is not None
                         else [self.router.decide(c) for c in contexts])
            for i, d in zip(free, decisions):
                plans[i] = (d.chain, d.k)
                self._floors[rows[i].seq_id] = d.min_confidence
            self._take_confident_drafts(rows, plans, free, contexts, pinned)
        return plans

    # -- confident drafts (suffix decoding) ------------------------------------------------------
    CONFIDENT = 0.5  # a confident draft: every token's cumulative confidence >= this
    CONFIDENT_MIN = 3  # ... and at least this many tokens
    CONFIDENT_MATCH = 8  # ... from a match of at least this many context tokens (one earlier
    # occurrence of a short match has confidence 1 and predicts little: measured, a 3-token
    # gate let chat greedy drop to 0.90x of SpecRouter without the suffix drafter)
    PEEK_BACKOFF = 4  # router steps between checks of a row whose last check found none

    def _take_confident_drafts(self, rows: list[Sequence], plans: list, free: list[int],
                               contexts: list[RowContext], pinned: list) -> None:
        """Suffix decoding's rule on top of the router's plans: a greedy row whose learning
        drafter (suffix) matches earlier requests with a long confident draft (an exact retry,
        a template's fixed text) runs that draft now when the cost model says the step gains
        (`Router.take_confident_drafts`). The router's acceptance estimates average over the
        request's cycles and cannot see such a draft coming. Skipped while the router holds the
        batch plain; a row that had none is checked again PEEK_BACKOFF steps later (a check
        costs one proposal, ~0.1-0.3 ms)."""
        take = getattr(self.router, "take_confident_drafts", None)
        drafters = [(n, d) for n, d in self.pool.drafters.items()
                    if getattr(d, "sized_by_confidence", False) and n not in self.failed_models]
        if take is None or not drafters or getattr(self.router, "plain_hold", None) is not None:
            return
        now = self.router.observed_steps
        offers: dict[int, tuple[str, int, float]] = {}
        for j, i in enumerate(free):
            seq = rows[i]
            chain, k = plans[i]
            k_cap = min(MAX_DRAFT_LENGTH, seq.remaining - 1)
            if not seq.params.greedy or k_cap < self.CONFIDENT_MIN or self._peek_at.get(seq.seq_id, 0) > now:
                continue
            context = as_int64(seq.tokens)
            for name, drafter in drafters:
                p = drafter.propose_row(context, k_cap, seq.tenant, self.CONFIDENT)
                m = int(p.tokens.shape[0])
                if (m >= self.CONFIDENT_MIN and p.match_len >= self.CONFIDENT_MATCH
                        and not (chain[0] == name and k >= m)):
                    offers[j] = (name, m, p.score)
            self._peek_at[seq.seq_id] = now + (1 if j in offers else self.PEEK_BACKOFF)
        if not offers:
            return
        new = take(contexts, [plans[i] for i in free], offers, pinned)
        for j, i in enumerate(free):
            if new[j] != plans[i]:
                plans[i] = new[j]
                self._floors[rows[i].seq_id] = self.CONFIDENT  # the executor drafts the same tokens

    def _on_step_failure(self, failure: ModelFailure, rows: list[Sequence],
                         plans: list[tuple[tuple[str, ...], int]]) -> bool:
        """A model failed in a step: take it out (`_on_model_failure`); True to retry the step."""
        chain = max((c for c, _ in plans), key=len)
        return self._on_model_failure(failure, rows, chain, 0) is not None

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
            mark_failed = getattr(self.router, "mark_failed", None)
            if mark_failed is not None:  # router plans avoid it from now on (cached decisions dropped)
                mark_failed(model)
        if self.on_model_failure is not None:
            self.on_model_failure(failure)
        for seq in rows:  # drop speculative tokens, keep the last committed token pending
            self.state.commit(seq.seq_id, seq.tokens, len(seq.tokens))
        if fatal:
            for seq in rows:
                seq.done, seq.finish_reason, seq.error = True, "error", str(failure)
            return None
        for seq in rows:  # pinned plans lose the model (router plans avoid it from now on)
            pinned = self._plans.get(seq.seq_id)
            if pinned is not None:
                self._plans[seq.seq_id] = (tuple(m for m in pinned[0] if m != model), pinned[1])
        return tuple(m for m in chain if m != model)  # == chain if it failed outside the chain

    # -- router feedback ----------------------------------------------------------------------
    SHADOW_EVERY_HELD = 4  # while the router holds a batch plain: shadow-score every 4th step

    def _shadow_due(self) -> bool:
        """Shadow proposals (evidence for model-free drafters not running) every step, or every
        SHADOW_EVERY_HELD-th while a plain hold lasts (router/batch.py): under load their
        ~0.3 ms per row is a few % of plain batching's step for evidence nobody reads until
        the hold ends."""
        if self.router is None:
            return False
        if getattr(self.router, "plain_hold", None) is None:
            return True
        return self.router.observed_steps % self.SHADOW_EVERY_HELD == 0

    def _shadow_proposals(self, rows: list[Sequence], plans) -> dict:
        """What each model-free drafter would propose for rows that do not run it (free
        evidence of its acceptance for this request: tens of microseconds per row)."""
        out = {}
        for name, drafter in self.pool.drafters.items():
            idx = [b for b, (chain, _) in enumerate(plans) if chain[0] != name]
            if not idx:
                continue
            tokens, lengths = drafter.propose([rows[b].tokens for b in idx], self.router.config.shadow_k,
                                              [rows[b].tenant for b in idx])
            out[name] = {b: t[:m] for b, t, m in zip(idx, tokens.tolist(), lengths.tolist())}
        return out

    def _observe(self, rows: list[Sequence], result: StepResult, shadow: dict | None) -> None:
        self.router.observe_step(result.outcomes, result.forwards, result.wall_time,
                                 sum(result.forward_time.values()), result.speculative)
        for name, proposals in (shadow or {}).items():
            for b, proposal in proposals.items():
                s, o = rows[b], result.outcomes[b]
                committed = s.tokens[o.context_len:]
                self.router.observe_shadow(s.seq_id, name, proposal, committed, self.router.config.shadow_k,
                                           s.params.greedy)
                drafted = result.proposals[b]
                if drafted:  # greedy, a model drafted: how it would judge `name`
                    self.router.observe_shadow(s.seq_id, name, proposal, drafted, len(drafted),
                                               True, verifier=o.chain[0], count_hit=False)

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
        seqs = [self.add_request(p, sp, chain=chain, k=k, generator=generator)
                for p, sp in zip(prompts, params)]
        previous, self.on_cycle = self.on_cycle, on_cycle
        try:
            while any(not s.done for s in seqs):
                self.step()
        finally:
            self.on_cycle = previous
            for s in seqs:
                if not s.done:
                    self.abort(s.seq_id)
        return seqs
