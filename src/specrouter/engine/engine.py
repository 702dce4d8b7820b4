"""The engine: requests in, committed tokens out, one cycle at a time (vLLM's LLMEngine shape).

`add_request` validates and registers a sequence, `step` runs one cycle for every running row
(one executor step: every model runs one forward over all rows that need it, whatever chain
and draft length each row runs), `abort` drops a row and frees its state. `generate_ids` is the
offline loop over these (its steps governed: contention.py, fewer torch threads while another
process takes a core).

Randomness is counter-based (decoding/noise.py): a row samples position i with noise keyed by
(its seed, i). A request's seed is `SamplingParams.seed`, else one drawn at `add_request` from
the given generator or the engine's own (`self.rng`), so the output of a seeded request is a
function of the request alone: the same at every run, concurrency and router decision, and
equal to plain decoding of the target with that seed.

Which chain and draft length a row runs: the one pinned at `add_request`, else the router's
(`RouterProtocol.plan_batch`, router/protocol.py), planned for the batch the step runs; a row's
plan lives in one record on its Sequence (`RowPlan`: pinned plan, confidence floor, next
confident-draft check, start time). Around the router's plans the engine asks the model-free
drafters for confident drafts and shadow proposals (drafts.py). A held batch's plans may come
with a lease (`BatchPlan.steps`): the engine runs the same rows on them without planning, and
reports those steps to the router in order when the lease ends (the rows change, it runs out, a
request finishes, a model fails), before the router plans again.

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
from specrouter.decoding.executor import ChainExecutor, StepResult
from specrouter.engine.busy_clock import BusyClock
from specrouter.engine.contention import governed
from specrouter.engine.tree_policy import TreePolicy
from specrouter.decoding.noise import seed_key
from specrouter.decoding.sampling import SamplingTensors
from specrouter.engine import constrained
from specrouter.engine.drafts import CONFIDENT, confident_offers, judge_shadows, shadow_proposals
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
from specrouter.records.routing import Plan, RowContext, RowPlan, StepReport, speculates
from specrouter.router.protocol import RouterProtocol
from specrouter.state.manager import StateManager
from specrouter.state.prefix_cache import PrefixCache
from specrouter.state.sequence import Sequence


def _feature_store(pool: Pool):
    """The target's features by slot when the pool has a draft head (state/features.py)."""
    if not pool.heads:
        return None
    from specrouter.state.features import FeatureStore

    target = pool.runners[pool.target]
    return FeatureStore(target.arch.hidden_size, target.dtype, target.device)


_ENGINE_IDS = itertools.count()

STEP_KINDS = ("held", "plain", "spec")  # Engine.last_step_kind


def step_kind(plans: list[Plan], held: bool) -> str:
    """A step's kind: "spec" when a row drafts, else "held" (plain under the router's plain hold,
    router/batch.py: the step that starts a hold, then its steps without per-row planning) or
    "plain" (planned plain without a hold, e.g. a single stream not yet settled; or no router)."""
    if speculates(plans):
        return "spec"
    return "held" if held else "plain"


class CapacityError(SpecRouterError):
    """No free cache slot (or not enough positions) for a new request right now."""


@dataclass
class StepOutput:
    """What one step did to one sequence."""

    seq: Sequence  # the row (its .tokens, .done, .finish_reason, .stats are up to date)
    new_token_ids: list[int]  # tokens committed by this step (after stop truncation)

    @property
    def new_logprobs(self) -> list | None:
        """The TokenLogprob of each new token (decoding/logprobs.py) for a row asking for
        logprobs, else None."""
        lp = self.seq.logprobs
        if self.seq.params.logprobs is None:
            return None
        return lp[len(lp) - len(self.new_token_ids):] if lp and self.new_token_ids else []


class Engine:
    """Owns the state manager and executor of one pool."""

    def __init__(
        self,
        pool: Pool,
        *,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        router: RouterProtocol | None = None,
        prefix_cache: bool = True,
        kv_cache_bytes: int | None = None,
    ):
        self.pool = pool
        # parked KV of finished rows, shared by every engine over these runners (None: off)
        self.prefix_cache = PrefixCache.of(pool.runners, kv_cache_bytes) if prefix_cache else None
        self.cache_scope = next(_ENGINE_IDS)  # prefix-cache entries are keyed (cache_scope, tenant)
        self.router = router  # picks chain and k of the rows that did not pin theirs, every step
        self.tree_policy: TreePolicy | None = None  # token-tree shapes (api.py sets it with a router)
        self.clock = clock
        self.busy_clock = BusyClock(clock)  # the clock less the caller's time between steps
        if router is not None and router.step_clock is not None:
            router.step_clock = self.busy_clock  # the router times the engine's own work only
        # every model's bits independent of torch's thread count: the loops may run fewer threads
        # under a co-tenant (contention.py); a model on torch's kernels keeps the thread count fixed
        self.thread_invariant = all(r.thread_invariant for r in pool.runners.values())
        self.state = StateManager(pool.runners, features=_feature_store(pool))
        self.executor = ChainExecutor(pool.runners, pool.drafters, self.state, pool.vocab_width,
                                      order=list(pool.order), heads=pool.heads, clock=clock)
        self.executor.measure_tv = router is not None and router.measure_tv  # (again after each plan_batch)
        if router is not None:
            self.executor.tv_positions = router.tv_positions
        self.rng = torch.Generator()  # seeds of requests without one (AsyncEngine reseeds it)
        self.rng.manual_seed(torch.seed())
        self._ids = itertools.count()
        self.running: dict[int, Sequence] = {}  # every row's plan is its `seq.plan` (RowPlan)
        self.steps = 0  # steps run (the clock of the rows' confident-draft checks)
        # the kind of the last step (STEP_KINDS: "held", "plain", "spec"; "" before any): the
        # serving metrics count steps by kind (server/metrics.py `observe_step`)
        self.last_step_kind = ""
        self._held = False  # the last plan was the router's hold (BatchPlan.held)
        self._catch_up: dict[int, tuple[str, ...]] = {}  # seq_id -> drafts caught up this step (BatchPlan.catch_up)
        # a lease (BatchPlan.steps): (the rows' seq_ids, their plans, steps left) the router let
        # stand; the steps run on it are reported to the router when it ends (`_report_lease`)
        self._lease: tuple[tuple[int, ...], list[Plan], int] | None = None
        self._unreported: list[StepReport] = []
        # the sampling tensors of the last step's rows (keyed by their seq_ids and parameters
        # objects): a request's SamplingParams are frozen, so the same rows reuse them (`_sampling_of`)
        self._sampling: tuple[tuple[tuple[int, int], ...], list[SamplingParams], SamplingTensors] | None = None
        self.fixed_capacity = max_num_seqs is not None and max_model_len is not None
        if self.fixed_capacity:
            for r in pool.runners.values():
                r.reserve(max_num_seqs + self._parked_slots(max_num_seqs, max_model_len), max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.on_cycle: Callable[[CycleStats], None] | None = None
        self.failed_models: set[str] = set()  # taken out of every chain (faults.py)
        self.on_model_failure: Callable[[ModelFailure], None] | None = None
        self._jump_forward = True

    @property
    def jump_forward(self) -> bool:
        """Grammar-forced tokens are committed without a forward (constrained.py) and join the
        drafts as certain candidates (decoding/certain_drafts.py; `executor.certain_drafts`
        alone turns that part off). False: plain constrained decoding, for comparisons."""
        return self._jump_forward

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self._jump_forward = self.executor.certain_drafts = bool(on)

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
        if params.grammar is not None:
            constrained.check_spec(self.pool, params.grammar)
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
        constrained.attach(self.pool, seq)
        if params.seed is not None:
            seed = params.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator or self.rng))
        seq.seed_key = seed_key(seed)
        self.state.add(seq.seq_id)
        seq.plan = RowPlan(pinned=(chain, k) if chain is not None else None, started=self.clock())
        if self.prefix_cache is not None:  # the longest cached prefix, in every model (adopted KV)
            seq.stats.cached_tokens = self.prefix_cache.adopt(
                seq.seq_id, seq.tokens, (self.cache_scope, tenant), self.state, self.pool.target).cached_tokens
        self.running[seq.seq_id] = seq
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
        seq.stats.wall_time = self.clock() - seq.plan.started
        if seq.finish_reason != "error":  # learning drafters (suffix) see every finished request
            for drafter in self.pool.drafters.values():
                drafter.observe_request(seq.tokens, seq.tenant)
        if self.prefix_cache is not None and seq.finish_reason != "error":
            self.prefix_cache.park(seq.tokens, (self.cache_scope, seq.tenant), self.state.detach(seq.seq_id))
        else:
            self.state.release(seq.seq_id)
        if self.router is not None:
            self._report_lease()  # its steps first (observing a row creates its request state)
            self.router.finish_request(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """`_step`, timed by the busy clock (engine/busy_clock.py: the time between steps is the caller's)."""
        self.busy_clock.enter()
        try:
            return self._step()
        finally:
            self.busy_clock.leave()

    def _step(self) -> list[StepOutput]:
        """One cycle for every running row: one executor step, every model at most one forward
        over all rows that need it; returns what each row committed. Randomness is
        counter-based (decoding/noise.py): keyed by each row's seed and position.
        0. constrained rows (constrained.py): forced tokens committed, complete or dead-end rows end;
        1. plan every row (pinned, or the router's for the batch, or a lease's plans); a row
           whose planning raises ends alone with finish_reason "error" (isolation.py);
        2. run the executor step over the rows (`_run_rows`): a row whose cycle raises ends
           alone, the others are rolled back and rerun alone; a failing model is taken out of
           the chains and the step retried (faults.py);
        3. report the committed step once to the router (on a lease: when it ends) and
           `on_cycle` (`_report`);
        4. collect each row's new tokens; finished rows leave the batch."""
        rows = list(self.running.values())
        if not rows:
            return []
        self.steps += 1
        outputs = []
        start = {s.seq_id: len(s.tokens) for s in rows}
        if any(s.grammar is not None for s in rows):  # forced tokens, complete / dead-end grammars
            constrained.before_step(rows, tuple(self.pool.eos_ids), self.jump_forward)
            outputs += [self._collect(s, start[s.seq_id]) for s in rows if s.done]
            rows = [s for s in rows if not s.done]
            if not rows:
                return outputs
        try:  # 1.
            plans, shadow_k = self._plan_step(rows)
        except Exception:  # noqa: BLE001 - find the rows whose planning fails alone
            plans, ok, shadow_k = [], [], 0
            for seq in rows:
                try:
                    plans.append(self._plan_step([seq])[0][0])
                    ok.append(seq)
                except Exception as e:  # noqa: BLE001 - this row's failure, not the batch's
                    fail_row(seq, e)
                    outputs.append(self._collect(seq, len(seq.tokens)))
            rows = ok
        if rows:  # 2. and 3.
            self.last_step_kind = step_kind(plans, self._held)
            before = [start[s.seq_id] for s in rows]
            plan_of = {s.seq_id: p for s, p in zip(rows, plans)}
            run_isolated(rows, lambda part: self._run_rows(part, [plan_of[s.seq_id] for s in part], shadow_k),
                         self.state, self._report)
            outputs += [self._collect(s, b) for s, b in zip(rows, before)]  # 4.
        return outputs

    def _plan_step(self, rows: list[Sequence]) -> tuple[list[Plan], int]:
        """Every row's (chain, k) for this step: pinned ones as pinned, the router's for the
        others (planned jointly, for the batch this step really runs), then the confident drafts
        the router takes (drafts.py); and the draft length of this step's shadow proposals."""
        plans: list = [s.plan.pinned for s in rows]
        self._held, self._catch_up = False, {}
        if self.router is None:
            return plans, 0
        ids = tuple(s.seq_id for s in rows)
        if (lease := self._lease) is not None:
            if lease[0] == ids and lease[2] > 0:  # the same rows: the held plans stand
                self._lease, self._held = (ids, lease[1], lease[2] - 1), True
                return list(lease[1]), 0
            self._lease = None
        self._report_lease()  # the router sees every step before it plans again
        free = [i for i, p in enumerate(plans) if p is None]
        pinned = [p for p in plans if p is not None]
        contexts = [RowContext(rows[i].seq_id, len(rows[i].tokens), batch_size=len(rows),
                               greedy=rows[i].params.greedy, remaining=rows[i].remaining,
                               processors=rows[i].params.has_processors,
                               certain_rate=constrained.certain_rate(rows[i]), **self._lags(rows[i]))
                    for i in free]
        batch = self.router.plan_batch(contexts, pinned)
        self.executor.measure_tv = self.router.measure_tv  # per step (router/evidence.py TvSchedule)
        self._held = batch.held
        for i, d in zip(free, batch.decisions):
            plans[i] = (d.chain, d.k)
            rows[i].plan.min_confidence = d.min_confidence
        for i, models in zip(free, batch.catch_up):  # drafts caught up for their evidence (router/catch_up.py)
            if models:
                self._catch_up[rows[i].seq_id] = models
        if free and not batch.held:
            drafters = {n: d for n, d in self.pool.drafters.items() if n not in self.failed_models}
            offers = confident_offers([rows[i] for i in free], [plans[i] for i in free], drafters, self.steps)
            if offers:
                taken = self.router.take_confident_drafts(contexts, [plans[i] for i in free], offers, pinned)
                for i, plan in zip(free, taken):
                    if plan != plans[i]:
                        plans[i] = plan
                        rows[i].plan.min_confidence = CONFIDENT  # the executor drafts the same tokens
        if batch.held and batch.steps > 1:
            self._lease = (ids, list(plans), batch.steps - 1)
        return plans, batch.shadow_k

    def _report_lease(self) -> None:
        """The steps run on a lease (`BatchPlan.steps`), told to the router in order (once: a
        report that raises loses that step's evidence, logged, as isolation.py's)."""
        reports, self._unreported = self._unreported, []
        for report in reports:
            try:
                self.router.observe_step(report)
            except Exception:  # noqa: BLE001 - the tokens are committed: only this step's evidence is lost
                fault_logger.exception("reporting a leased step to the router raised; its evidence is lost")

    def _lags(self, seq: Sequence) -> dict:
        """`RowContext.lags`: the row's models below the target (model-free drafters aside) that
        have not seen more than its last token (a model never run for it: none of it); and
        `lags_generated`: how many of those tokens the row generated (the rest: its prompt)."""
        states, n = self.state.states_of(seq.seq_id), len(seq.tokens)
        lags, generated = [], []
        for m in self.pool.order:
            if m != self.pool.target and m in self.pool.runners:
                st = states.get(m)
                seen = st.cache_len if st is not None else 0
                if n - seen > 1:
                    lags.append((m, n - seen))
                    generated.append((m, n - max(seen, seq.prompt_len)))
        return {"lags": tuple(lags), "lags_generated": tuple(generated)}

    def _run_rows(self, rows: list[Sequence], plans: list[Plan], shadow_k: int
                  ) -> tuple[StepResult | None, dict, int]:
        """One executor step over `rows`, row b running `plans[b]`: its result (None when the
        target failed and the rows ended), the shadow proposals made before it and their k."""
        sampling = self._sampling_of(rows)
        fields = self.executor.field_drafts and self.executor.certain_drafts
        shadow = shadow_proposals(rows, plans, self.pool.drafters, shadow_k, fields) if shadow_k else {}
        # a model that raised or timed out is out of every chain; on a failure the rows are
        # rolled back to their committed tokens and the step is retried without it (the
        # target failing ends the rows with "error"): faults.py
        while True:
            plans = [(without_failed(c, self.failed_models, self.pool.target), k) for c, k in plans]
            try:
                trees = self.tree_policy.shapes(rows, plans) if self.tree_policy is not None else None
                self.executor.prune_tree = self.tree_policy.prune if self.tree_policy is not None else None
                catch = [tuple(m for m in self._catch_up.get(s.seq_id, ()) if m not in self.failed_models)
                         for s in rows] if self._catch_up else None
                result = self.executor.step(rows, plans, sampling, [s.plan.min_confidence for s in rows], trees, catch)
                return result, shadow, shadow_k
            except ModelFailure as failure:
                if not self._on_step_failure(failure, rows, plans):
                    return None, shadow, shadow_k

    def _sampling_of(self, rows: list[Sequence]) -> SamplingTensors:
        """The rows' SamplingTensors, built once per row set: four `torch.tensor` calls a step
        (~0.1 ms on a Zen 1) for parameters that never change while the same rows run. Keyed by
        each row's id and its (frozen) parameters object, so a row given new parameters is read
        anew (the entry keeps the objects alive: their ids cannot be reused while it stands)."""
        ids = tuple((s.seq_id, id(s.params)) for s in rows)
        if self._sampling is None or self._sampling[0] != ids:
            params = [s.params for s in rows]
            self._sampling = (ids, params, SamplingTensors.from_params(params, device=self.pool.device))
        return self._sampling[2]

    def _report(self, rows: list[Sequence], ran: tuple[StepResult | None, dict, int]) -> None:
        """A committed step told to the router and `on_cycle` (once: isolation.py)."""
        result, shadow, shadow_k = ran
        if result is None:
            return
        if self.tree_policy is not None:
            self.tree_policy.observe(result, rows)
        if self.router is not None:
            report = StepReport(
                outcomes=result.outcomes, forwards=result.forwards, wall_time=result.wall_time,
                forward_time=sum(result.forward_time.values()), speculative=result.speculative,
                shadow=judge_shadows(rows, result.outcomes, result.proposals, shadow, shadow_k, self.pool.drafters),
                tv_seconds=result.tv_seconds, draft_steps=result.draft_steps,
                draft_host_seconds=result.draft_host_seconds, processor_seconds=result.processor_seconds,
                processor_rows=result.processor_rows)
            if self._lease is not None:  # told when the lease ends (`_report_lease`)
                self._unreported.append(report)
            else:
                self.router.observe_step(report)
        if self.on_cycle is not None:
            for stats in result.cycles:
                self.on_cycle(stats)

    def _collect(self, seq: Sequence, before: int) -> StepOutput:
        """The row's output of this step; a finished row leaves the batch."""
        if len(seq.tokens) > before and not seq.stats.first_token_time:
            seq.stats.first_token_time = self.clock() - seq.plan.started
        if seq.done:
            self.running.pop(seq.seq_id, None)
            self._finish(seq)
        return StepOutput(seq=seq, new_token_ids=seq.tokens[before:])

    # -- model failures (faults.py) ------------------------------------------------------------
    def _on_step_failure(self, failure: ModelFailure, rows: list[Sequence], plans: list[Plan]) -> bool:
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
        self._lease = None  # plans are made afresh without the model
        if model != target or failure.kind == "timeout":
            self.failed_models.add(model)
            if self.router is not None:  # router plans avoid it from now on (cached decisions dropped)
                self._report_lease()
                self.router.mark_failed(model)
        if self.on_model_failure is not None:
            self.on_model_failure(failure)
        for seq in rows:  # drop speculative tokens, keep the last committed token pending
            self.state.commit(seq.seq_id, seq.tokens, len(seq.tokens))
        if fatal:
            for seq in rows:
                seq.done, seq.finish_reason, seq.error = True, "error", str(failure)
            return None
        for seq in rows:  # pinned plans lose the model (router plans avoid it from now on)
            pinned = seq.plan.pinned
            if pinned is not None:
                seq.plan.pinned = (tuple(m for m in pinned[0] if m != model), pinned[1])
        return tuple(m for m in chain if m != model)  # == chain if it failed outside the chain

    def recover_from_hang(self, failure: ModelFailure) -> None:
        """The step in flight was abandoned: a forward of `failure.model` hung and the server's
        watchdog retired the thread running it (faults.py), so that step never returns. Take the
        model out and roll every running row back to its committed tokens, as a failure raised
        in the step would (`_on_model_failure`; a hung target ends the rows with "error"); rows
        that step finished before the hang leave the batch. The next `step()` carries on."""
        live = [s for s in self.running.values() if not s.done]
        self._on_model_failure(failure, live, tuple(self.pool.order), 0)
        for seq in [s for s in self.running.values() if s.done]:
            self.running.pop(seq.seq_id)
            self._finish(seq)

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
            # the calling thread's torch threads: fewer while another process takes a core (contention.py)
            with governed(enabled=self.thread_invariant) as timed:
                while any(not s.done for s in seqs):
                    timed(self.step)
        finally:
            self.on_cycle = previous
            for s in seqs:
                if not s.done:
                    self.abort(s.seq_id)
        return seqs
