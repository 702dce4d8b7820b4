"""The router's boundary dataclasses (its settings, `RouterConfig`, are in config.py): what it
is told about a row before a cycle (`RowContext`) and after a step (`StepReport`: `RowOutcome`,
`ForwardRecord`, `ShadowProposal`), what it answers (`Decision`, `BatchPlan`, `DecisionEvent`),
and the engine's record of a row's plan (`RowPlan`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Chain = tuple[str, ...]  # model names, drafter first, target last
Pair = tuple[str, str]  # (drafter, verifier): the lower level first
Plan = tuple[Chain, int]  # (chain, draft length k); k == 0 with the target-only chain: plain decoding


def speculates(plans: Sequence[Plan]) -> bool:
    """Does some row of a step draft (a chain below the target with k > 0)?"""
    return any(k > 0 and len(c) > 1 for c, k in plans)


def widened(outcomes: Sequence["RowOutcome"], forwards: Sequence["ForwardRecord"]) -> bool:
    """Did a step prefill a prompt or catch a model up on tokens it had not seen: a forward
    wider than any row's plan asks (a draft of k through n levels verifies at most k + n - 1
    tokens at its last level; plain decoding one) by more than one token? Such a step is not a
    decoding cycle: what it costs grows with the prompt or the lag."""
    widest = max((o.k + len(o.chain) - 1 if len(o.chain) > 1 and o.k > 0 else 1 for o in outcomes), default=1)
    return any(f.new_tokens > widest + 1 for f in forwards)


@dataclass(frozen=True)
class RowContext:
    """What the router needs to know about a row to decide its next cycle."""

    seq_id: int  # request id (Sequence.seq_id)
    context_len: int  # tokens in the row now (prompt + generated): L of its forwards
    batch_size: int = 1  # rows its forwards are batched with: b of T_M(b, t, L)
    greedy: bool = True  # temperature 0
    remaining: int | None = None  # tokens it may still generate (k <= remaining - 1); None: no cap
    processors: bool = False  # some logits processor is on: each forward it takes part in costs the router's "processor" seconds more
    certain_rate: float = 0.0  # grammar-forced tokens per token a model chose, so far (a constrained
    #                            row: they ride in its drafts as certain ones, cost_model.with_certain)
    # (model, tokens it has not seen) of the models below the target that lag by more than one
    # token: fed at the start of the row's next cycle that runs them (a draft's catch-up after
    # plain steps, a new request's prompt); the batch planner prices it (BatchPlanner.step_seconds)
    lags: tuple[tuple[str, int], ...] = ()
    # of those tokens, (model, how many) the row generated itself (decoded while that model did
    # not run: plain steps), the rest being its prompt: a model lagging only on these has a
    # catch-up that plain steps of this request made (BatchPlanner.alone prices it per request)
    lags_generated: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    """The plan of one row for one cycle."""

    chain: Chain  # models to run, drafter first, target last
    k: int  # draft length; 0 for the target-only chain (plain decoding)
    t_eff: float  # predicted seconds per committed target token of this plan
    reason: str  # initial | same | better | changed | fallback | persistent | hysteresis | invalid | probe | end | only
    min_confidence: float = 0.0  # a confidence-sized drafter first (suffix) stops below this (break-even acceptance)


@dataclass(frozen=True)
class DecisionEvent:
    """One decision, for metrics and plots (`Router.events`, `Router.on_decision`)."""

    step: int  # row-cycles observed by the router when it decided
    seq_id: int  # the request
    chain: Chain  # what runs
    k: int  # its draft length (0: plain)
    t_eff: float  # its predicted seconds per target token
    reason: str  # see Decision.reason
    switched: bool  # the request's plan changed (probes do not change it)
    best_chain: Chain  # argmin of the predicted T_eff this time
    best_k: int
    best_t_eff: float
    plain_t_eff: float  # predicted seconds per token of plain decoding
    batch_size: int  # b used for T_M
    context_len: int  # L used for T_M
    mode: str  # greedy | sampling
    alphas: dict[Pair, float]  # the acceptance estimates used
    decide_seconds: float  # wall time of decide() itself


@dataclass(frozen=True)
class RowOutcome:
    """What one cycle did to one row (the executor's per-row counters)."""

    seq_id: int  # the request
    chain: Chain  # chain that ran (CycleStats.chain: (target,) when no candidate was drafted)
    k: int  # draft length asked of the drafter for this row (0 for plain decoding)
    drafted: Sequence[int]  # per level, as CycleStats.drafted (0: proposed; j >= 1: candidates reaching level j)
    accepted: Sequence[int]  # per level, as CycleStats.accepted (0 unused)
    greedy: bool = True  # the row decodes greedily
    context_len: int = 0  # tokens in the row before the cycle (L of its forwards)
    tv: Sequence[float] | None = None  # per level j >= 1: mean D_TV (level j-1 vs j) at its first
    #                                     candidates (RouterProtocol.tv_positions); NaN: none; None: not measured
    certain: int = 0  # grammar-forced candidates the target committed (decoding/certain_drafts.py):
    #                   not in `drafted` / `accepted`, which count the drafters' own candidates
    # (model, matches, trials) of each model draft the row caught up this cycle (router/catch_up.py):
    # its tokens at the positions the row generated against the committed ones, teacher-forced
    caught_up: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class ForwardRecord:
    """One timed forward (or `count` identical ones), as the executor measures it."""

    model: str  # pool name (or a model-free drafter's: its proposal)
    rows: int  # b
    new_tokens: float  # t: new tokens per row: the padded width, or the mean width for a
    #                    runner that packs ragged batches (a model-free drafter: k)
    context_len: int  # L: mean cached positions of the rows before the forward
    seconds: float  # wall time, all `count` forwards together
    count: int = 1  # e.g. a draft model's k sequential one-token steps


@dataclass(frozen=True)
class BatchPlan:
    """The router's answer for one engine step (`RouterProtocol.plan_batch`)."""

    decisions: list[Decision]  # one per row asked about, in order
    held: bool = False  # the batch's plans are held (router/batch.py: plain, or a batch's speculative ones): no per-row re-planning now
    shadow_k: int = 0  # draft length of this step's shadow proposals (0: none this step)
    # a lease: these plans stand this many steps (this one first) for exactly the same rows,
    # without shadow proposals after this one; the engine runs them without asking again and
    # reports those steps when the lease ends (router/batch.py `BatchPlanner.plan`: a held batch)
    steps: int = 1
    # per row asked about: the model drafts it catches up this step for their evidence, in a
    # forward of their own (router/catch_up.py); () for every row when empty
    catch_up: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class ShadowProposal:
    """What a model-free drafter the row did not run would have proposed, against what it is
    judged by: the tokens the target committed, or the own tokens of the row's first model level
    this cycle (`verifier` names that model; its hit was already counted: `count_hit` False)."""

    seq_id: int  # the request
    drafter: str  # the model-free drafter
    proposal: Sequence[int]  # its proposal, asked for `k` tokens before the cycle
    judged_by: Sequence[int]  # the tokens it is compared with
    k: int  # draft length it was asked for
    greedy: bool = True  # the row decodes greedily
    verifier: str | None = None  # None: the target
    count_hit: bool = True  # count the proposal as a hit or a miss of the drafter


@dataclass(frozen=True)
class StepReport:
    """Everything one engine step tells the router (`RouterProtocol.observe_step`)."""

    outcomes: Sequence[RowOutcome]  # one per row of the step
    forwards: Sequence[ForwardRecord]  # every timed forward of the step
    wall_time: float  # seconds of the executor's step
    forward_time: float  # of which inside forwards
    speculative: bool  # some row ran a drafter
    shadow: Sequence[ShadowProposal] = ()  # shadow scoring of model-free drafters
    tv_seconds: float = 0.0  # of the wall time, measuring D_TV at the verified positions
    draft_steps: int = 0  # sequential draft forwards after each drafter's first (k - 1 per draft of k)
    draft_host_seconds: float = 0.0  # of the wall time, those steps' host work outside their forwards
    processor_seconds: float = 0.0  # of the wall time, the rows' logits processors (decoding/processors.py)
    processor_rows: int = 0  # ... over this many row-forwards (a row with processors in a processed forward)


@dataclass
class RowPlan:
    """The engine's record of one row's plan (one per row, on its `Sequence`)."""

    pinned: Plan | None  # the (chain, k) the request asked for; None: the router decides
    started: float  # the engine clock at add_request (RequestStats.wall_time)
    min_confidence: float = 0.0  # of this step's plan (Decision.min_confidence)
    peek_at: int = 0  # the engine step from which its confident-draft check runs again
