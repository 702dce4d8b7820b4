"""The step executor: one cycle of multi-level speculative decoding for EVERY running row at
once, whatever chain and draft length each row runs (docs/design.md pillar 2 and the paper's
asynchronous batch processing). Every model runs one forward over all rows that need it now.

Models are visited in pool order (cheapest first, the target last). A chain is ordered the same
way, so when a model's turn comes the candidates of every row it verifies are ready:
1. model-free drafters propose for the rows whose chain starts with them (one call each, per-row k);
2. each model `M`, in order: ONE forward over the rows that verify with it (their pending tokens
   plus the candidates from the level below) and the rows that draft with it (their pending
   tokens: the first draft step); every row reads the token it samples at each position
   (`sampling.choose_tokens`: argmax, or counter-based noise keyed by the row's seed and the
   position, the same at every level) and verifies its candidates against them
   (`verification.verify_tokens`); a drafting row then runs its remaining draft steps, one
   forward per step over the rows still drafting (ragged k);
3. at the target, every row commits what it accepted plus its recovered/bonus token (truncated
   at stop tokens / max_new_tokens) and every model keeps the prefix of what it cached that was
   committed (`StateManager.commit`).

Log-probabilities (decoding/logprobs.py), for the rows that ask: at the target, from the
logits of the forward that committed the tokens (after the rows' processors, the distribution
each was sampled from), no forward of their own; a row asking for prompt logprobs prefills its
prompt in the target in a forward that returns every position (`_prompt_logprobs`) at its
first cycle.

A draft head (models/heads/level.py) drafts like a model drafter, first in its chains, from the
target's features the state manager keeps (decoding/head_drafting.py); the target's forward
returns and stores features only in a step where some row drafts with a head.

So a step with rows on [ngram, target], [draft, target] and [ngram, draft, target] runs the
n-gram once, the draft once per draft step, the target once. A row's output is exactly what
the target samples alone (greedy: argmax; sampling: the target's noisy argmax at each position,
an exact sample of its processed distribution), so rows never depend on each other or on the
chain: seeded requests are reproducible whatever the router does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specrouter.decoding import certain_drafts as certain
from specrouter.drafters.base import ModelFreeDrafter
from specrouter.decoding.field_gate import Contest
from specrouter.decoding.catch_up import catch_up_drafts, caught_up_trials
from specrouter.decoding.head_drafting import draft_with_head, refeed_gaps
from specrouter.decoding.lazy_mask import choose_refused, lazy
from specrouter.decoding.logprobs import generated_logprobs, prompt_logprobs
from specrouter.decoding.processors import PenaltyMemo, RowHistory, process_rows
from specrouter.decoding.sampling import SamplingTensors, choose_at
from specrouter.decoding.tv import tv_rows
from specrouter.models.device import synchronize
from specrouter.decoding.verification import verify_rows
from specrouter.decoding.tree import TokenTree, feed_parents, path_independent, token_offsets, walk
from specrouter.decoding.free_tree import free_tree_ok, take_free_tree
from specrouter.decoding.tree_drafting import DraftTree, draft_tree
from specrouter.records.stats import CycleStats
from specrouter.models.runners.base import ForwardBatch, ModelRunner
from specrouter.records.routing import ForwardRecord, RowOutcome
from specrouter.state.features import after_forward
from specrouter.state.manager import StateManager
from specrouter.state.sequence import Sequence


def cut(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Logits cut to the pool's common width (themselves when they have it already)."""
    return logits if logits.shape[-1] == width else logits[..., :width]


def token_positions(work: list["RowWork"], G: int, offset: int = 0, offsets: list[list[int]] | None = None) -> list[int]:
    """The sequence position of each of G logits per row (row-major, B*G): start + offset + g,
    or start + offsets[b][g] (a tree's nodes); a row's noise there is keyed by (its seed, it)."""
    if offsets is None:
        return [w.start + offset + g for w in work for g in range(G)]
    return [w.start + o for w, offs in zip(work, offsets) for o in offs]


@dataclass
class RowWork:
    """One row's cycle in progress (index b of the step)."""

    b: int  # index of the row in the step (its SamplingTensors row)
    seq: Sequence
    chain: tuple[str, ...]  # levels it runs this cycle (drafter first, target last)
    k: int  # draft length asked of the drafter (0: plain decoding)
    cap: int  # most candidates worth passing up: remaining - 1
    start: int  # committed tokens before the cycle = position of the first new token
    cand: list[int] = field(default_factory=list)  # candidates for the next level
    drafted: list[int] = field(default_factory=list)  # per level: 0 = proposed; j >= 1 = candidates reaching level j
    accepted: list[int] = field(default_factory=list)  # per level: candidates level j accepted (0 unused)
    # the first model level's own tokens this cycle, for shadow scoring (engine/drafts.py): a model
    # drafter's proposal, or (a model-free drafter first) what its verifier passed up: accepted
    # candidates and its own token. Its own samples at those positions in both modes (greedy
    # argmax; sampling with the position-keyed noise every level shares), so a model-free
    # proposal matching them is exactly what that model would have accepted
    proposal: list[int] | None = None
    min_confidence: float = 0.0  # a confidence-sized drafter stops below this (Decision.min_confidence)
    # per candidate, the logits (V,) the level below had at its position (copies: runners may
    # reuse their output buffers); None: a model-free drafter, nothing to compare
    cand_logits: list[torch.Tensor] | None = None
    tv: list[float] = field(default_factory=list)  # per level j >= 1: mean D_TV (j-1 vs j) at its candidates; NaN: none
    logprobs: list | None = None  # the target's TokenLogprob of each token in `cand` (rows asking)
    prompt_logprobs: list | None = None  # its prompt's, when this cycle prefilled them
    # a token tree (docs/trees.md): the node budget and width asked (0: a chain), the tree the
    # drafter grew, the tree the target verifies (its nodes' ids in the draft tree), what it accepted
    tree_budget: int = 0
    tree_width: int = 1  # nodes expanded per depth (the frontier)
    tree_children: int = 0  # children per expanded node (0: tree_width)
    draft_tree: DraftTree | None = None
    tree: TokenTree | None = None
    tree_ids: list[int] = field(default_factory=list)
    ranks: tuple[int, ...] = ()  # rank evidence along the accepted branch (DraftTree.evidence)
    tree_accepted: int = 0  # nodes of the accepted branch
    # grammar-forced candidates (decoding/certain_drafts.py): whether this row gets them, the
    # positions in `cand` that hold one, and how many the target committed
    forcing: bool = False
    forced: list[int] = field(default_factory=list)
    certain: int = 0
    values: list[int] = field(default_factory=list)  # where JSON values start in a field-drafted `cand`
    contest: Contest | None = None  # field draft against the drafter's proposal (decoding/field_gate.py)
    processors: bool = False  # the row's parameters have logits processors (SamplingParams.has_processors)
    # per model draft caught up this cycle (router/catch_up.py): (model, the positions its tokens
    # were sampled for, those tokens), scored against the committed ones in `_result` (decoding/catch_up.py)
    caught: list[tuple[str, list[int], list[int]]] = field(default_factory=list)

    def level(self, model: str) -> int:
        """Index of `model` in the row's chain (-1: not in it)."""
        return self.chain.index(model) if model in self.chain else -1


@dataclass
class StepResult:
    """What one step did: per-row outcomes for the router, per-chain summaries for metrics."""

    outcomes: list[RowOutcome]  # one per row, in the order of the rows passed in
    proposals: list[list[int]]  # per row: its first model level's own tokens (RowWork.proposal; [] none)
    forwards: list[ForwardRecord]  # every timed forward of the step
    cycles: list[CycleStats]  # per chain that ran: counters (forward times only in the first)
    forward_time: dict[str, float]  # seconds per model over the step
    wall_time: float  # seconds for the whole step
    speculative: bool  # some row ran a drafter
    tv_seconds: float = 0.0  # of the wall time, measuring D_TV at the verified positions
    draft_steps: int = 0  # sequential draft forwards after each drafter's first (k - 1 per draft of k)
    draft_host_seconds: float = 0.0  # of the wall time, those steps' host work outside their forwards
    processor_seconds: float = 0.0  # of the wall time, the rows' logits processors
    processor_rows: int = 0  # ... over this many row-forwards (rows with processors, summed over forwards)
    trees: list[TreeOutcome] = field(default_factory=list)  # the rows that verified a token tree


@dataclass(frozen=True)
class TreeOutcome:
    """One row's token-tree cycle (engine/tree_policy.py learns from these)."""

    seq_id: int
    nodes: int  # nodes verified (besides the root and pending tokens)
    width: int  # candidates per depth offered (main + alternatives)
    main: int  # main-path nodes in the tree (the chain it replaced)
    accepted: int  # nodes of the accepted branch
    main_accepted: int  # of them on the main path before any alternative
    ranks: tuple[int, ...]  # rank evidence per depth reached (tree_drafting.rank_evidence)
    children: int = 0  # children offered per expanded node (a rank of -1: not among this many)


class ChainExecutor:
    """Runs steps over a pool of runners and model-free drafters that share one vocabulary.

    `order` is the pool order (cheapest first, the target last); `vocab_width` the common logits
    width: logits of every model are cut to it, at every level and in plain decoding alike, so
    the target's distribution is the same either way.
    """

    def __init__(
        self,
        runners: dict[str, ModelRunner],
        drafters: dict[str, ModelFreeDrafter],
        state: StateManager,
        vocab_width: int,
        order: list[str] | None = None,
        heads: frozenset[str] = frozenset(),
        clock=time.perf_counter,
    ):
        self.runners = runners
        self.drafters = drafters
        self.state = state
        self.vocab_width = vocab_width
        self.order = list(order) if order is not None else [*drafters, *runners]
        self.target = self.order[-1]
        self.heads = frozenset(heads)  # draft heads among the runners (Pool.heads)
        if self.heads and state.features is None:
            raise ValueError("a pool with a draft head needs a StateManager with a FeatureStore")
        self.clock = clock  # timing source (tests inject a virtual clock)
        self.measure_tv = False  # measure D_TV at verified positions (the router's similarity signal)
        self.tv_positions = 2  # ... at each row's first this many candidates per level (sampled rows)
        self.certain_drafts = True  # grammar-forced tokens join the drafts (certain_drafts.py)
        # a constrained row's model-free drafts may be field drafts (field_drafts.py; needs certain_drafts)
        self.field_drafts = True
        # how many of a model-free tree proposal's nodes a row verifies: (RowWork, TreeProposal)
        # -> n (0, or a chain of nodes: the main path as a chain); None: all (engine/tree_policy.py)
        self.prune_tree = None
        self.certain_counts = certain.CertainCounts()  # what the levels did with them

    # -- one step ---------------------------------------------------------------------------
    def step(
        self,
        rows: list[Sequence],
        plans: list[tuple[tuple[str, ...], int]],
        sampling: SamplingTensors,
        min_confidence: list[float] | None = None,
        trees: list[tuple[int, int]] | None = None,
        catch_up: list[tuple[str, ...]] | None = None,
    ) -> StepResult:
        """One cycle for every row, row b running `plans[b] = (chain, k)`; commits >= 1 token
        per row. Rows' random numbers come from `seq.seed_key` and positions only.
        `min_confidence[b]`: where a confidence-sized drafter drafting for row b stops.
        `trees[b] = (budget, width[, depth])`: row b's model drafter grows a token tree `depth`
        deep (default: its k), `width` nodes expanded per depth into `width` children each,
        and the target verifies its best `budget` nodes (a budget <= depth: the chain); only
        where the tree can run (`_tree_ok`). `catch_up[b]`: model drafts row b's chain leaves
        out that catch up on its committed tokens first, for their evidence
        (decoding/catch_up.py `catch_up_drafts`)."""
        t_start = self.clock()
        self._forwards: list[ForwardRecord] = []
        self._ftime: dict[str, float] = {}
        self._ftoks: dict[str, int] = {}
        self._tv_seconds = 0.0
        self._fsum = 0.0  # seconds inside forwards and proposals so far this step
        self._steps_drafted, self._draft_host = 0, 0.0
        self._proc_seconds, self._proc_rows = 0.0, 0
        work = [self._start_row(b, s, chain, k) for b, (s, (chain, k)) in enumerate(zip(rows, plans))]
        for w, floor in zip(work, min_confidence or ()):
            w.min_confidence = floor
        heads_draft = any(w.chain[0] in self.heads and w.k > 0 for w in work)
        for w, shape in zip(work, trees or ()):
            budget, width = shape[0], shape[1]
            depth = min(shape[2], w.cap) if len(shape) > 2 and shape[2] is not None and w.k > 0 else w.k
            if free_tree_ok(self, w, budget, depth):  # a model-free drafter's tree: its own shape
                w.k, w.tree_budget = depth, budget
            elif budget > depth > 0 and width > 1 and not heads_draft and self._tree_ok(w, budget, width, depth):
                w.k, w.tree_budget, w.tree_width = depth, budget, width
                w.tree_children = shape[3] if len(shape) > 3 else 0
        if catch_up:
            catch_up_drafts(self, work, catch_up, sampling)
        for name in self._models_in_use(work):
            if name in self.drafters:
                self._propose(name, [w for w in work if w.chain[0] == name and w.k > 0])
            elif name in self.heads:
                draft_with_head(self, name, [w for w in work if w.chain[0] == name and w.k > 0], sampling)
            else:
                self._run_model(name, work, sampling)
        return self._result(work, t_start)

    def _start_row(self, b: int, seq: Sequence, chain: tuple[str, ...], k: int) -> RowWork:
        """A row's effective plan: a row that may generate r more tokens gains nothing from
        more than r - 1 candidates, and k drafted tokens reach position len(tokens) + k - 1 at
        a verifier, so near the end of the context k shrinks to what every cache of the chain
        holds (a request never reserves positions for drafting); with no candidate worth
        drafting it decodes plainly."""
        cap = max(0, seq.remaining - 1)
        if len(chain) > 1:
            room = min((self.runners[m].max_len for m in chain if m in self.runners), default=0)
            if room:
                cap = min(cap, max(0, room - len(seq.tokens)))
        k = min(k, cap) if len(chain) > 1 else 0
        chain = chain if k > 0 else chain[-1:]
        n = len(chain)
        return RowWork(b=b, seq=seq, chain=chain, k=k, cap=cap, start=len(seq.tokens),
                       drafted=[0] * n, accepted=[0] * n, tv=[math.nan] * n,
                       forcing=k > 0 and self.certain_drafts and certain.forcing(seq),
                       processors=seq.params.has_processors)

    def measures_tv(self, w: RowWork) -> bool:
        """Row w's D_TV is measured this cycle: measuring is on and the row is sampled (the
        router reads no greedy row's D_TV, so their logits are neither kept nor compared;
        `SimilarityConfig.greedy_tv`, which measured them, was removed in session 22)."""
        return self.measure_tv and not w.seq.params.greedy

    def draft_step_started(self) -> tuple[float, float]:
        """The clock and the forward (and logits processors') seconds at the start of a draft
        step (`draft_step_done`)."""
        return self.clock(), self._fsum + self._proc_seconds

    def draft_step_done(self, started: tuple[float, float]) -> None:
        """One draft step ended: its host work (wall outside its forward: building the batch,
        choosing the tokens, reading them back; the rows' processors are charged apart) is
        counted for the router's cost model."""
        t0, f0 = started
        self._steps_drafted += 1
        self._draft_host += max(self.clock() - t0 - (self._fsum + self._proc_seconds - f0), 0.0)

    def _tree_ok(self, w: RowWork, budget: int, width: int, depth: int) -> bool:
        """A row may verify a tree: a model drafter straight below the target (no pruning
        level), both running trees, room in both caches for the nodes side by side (the
        drafter's forwards feed up to width * (depth - 1), the target's budget + 1), and the
        row's sampling independent of the path (decoding/tree.py `path_independent`)."""
        if not (len(w.chain) == 2 and w.chain[0] in self.runners and w.chain[0] not in self.heads
                and all(self.runners[m].supports_trees for m in w.chain)):
            return False
        room = min(self.runners[m].max_len for m in w.chain) - w.start
        return room > max(budget, width * depth) and path_independent(w.seq)

    def _models_in_use(self, work: list[RowWork]) -> list[str]:
        used = {m for w in work for m in w.chain}
        return [m for m in self.order if m in used]

    # -- drafting ---------------------------------------------------------------------------
    def _propose(self, name: str, work: list[RowWork]) -> None:
        """A model-free drafter proposes up to k tokens for each of its rows (one call)."""
        if not work:
            return
        drafter = self.drafters[name]
        t0 = self.clock()
        grow = [w for w in work if w.tree_budget]
        if grow:  # rows verifying a token tree of the drafter's continuations
            props = drafter.propose_trees([w.seq.tokens for w in grow], [w.tree_budget for w in grow],
                                          [w.k for w in grow], [w.seq.tenant for w in grow],
                                          [w.min_confidence for w in grow])
            for w, prop in zip(grow, props):
                take_free_tree(w, prop, self.prune_tree)
            work = [w for w in work if not w.tree_budget]
        floors = [w.min_confidence for w in work]
        sized = {"min_confidence": floors} if any(floors) and drafter.sized_by_confidence else {}
        tokens, lengths = (drafter.propose([w.seq.tokens for w in work], [w.k for w in work],
                                           [w.seq.tenant for w in work], **sized) if work else (torch.zeros(0, 0), torch.zeros(0)))
        for w, toks, m in zip(work, tokens.tolist(), lengths.tolist()):
            w.cand = toks[: min(m, w.cap)]
            if w.seq.grammar is not None:  # only what the grammar allows goes up the chain
                w.cand = w.cand[: w.seq.grammar.valid_prefix(w.seq.output_ids, w.cand)]
            if w.forcing and self.field_drafts:  # the field draft, where they differ (certain_drafts.preferred)
                certain.take_field_draft(w, 0)
            if w.forcing and w.cand:  # (before any proposal, jump forward took the forced tokens)
                certain.propose_after_forced(drafter, w, self.field_drafts)
                if self.field_drafts and certain.offers_fields(w):
                    certain.cut_values(w, w.seq.grammar.fields)
            w.drafted[0] = certain.own_count(w, len(w.cand))
        work = work + grow
        dt = self.clock() - t0
        self._ftime[name] = self._ftime.get(name, 0.0) + dt
        self._fsum += dt
        self._forwards.append(ForwardRecord(model=name, rows=len(work), new_tokens=max(w.k for w in work),
                                            context_len=sum(w.start for w in work) // len(work), seconds=dt))

    def _draft_steps(self, name: str, work: list[RowWork], first: list[int], first_logits: torch.Tensor,
                     sampling: SamplingTensors) -> None:
        """Draft tokens 2..k of the rows drafting with model `name` (their first token came from
        the shared forward, with `first_logits` (B, V)): one one-token forward per step over the
        rows still drafting."""
        for w, t, x in zip(work, first, first_logits):
            w.cand, w.cand_logits = [t], [x.clone()] if self.measures_tv(w) else None
            if w.forcing:  # the tokens the grammar forces after it: certain, no draft step
                certain.extend(w)
        more = lambda w: certain.own_count(w, len(w.cand)) < w.k and len(w.cand) < w.cap  # noqa: E731
        active = [w for w in work if more(w)]
        while active:
            step = self.draft_step_started()
            feeds = []
            for w in active:  # feed what is not fed yet: the last draft token and the forced ones after it
                st = self.state.state(w.seq.seq_id, name)
                new = w.cand[len(st.speculative):]
                feeds.append((st.slot, st.cache_len + len(st.speculative), new))
                st.speculative.extend(new)
            batch = ForwardBatch.build([f[0] for f in feeds], [f[1] for f in feeds], [f[2] for f in feeds],
                                       [[len(f[2]) - 1] for f in feeds])
            width = batch.tokens.shape[1]
            if self.runners[name].packs_ragged:
                width = sum(batch.num_tokens_list) / len(active)
            logits = self._timed_forward(name, batch, len(active), width)  # (B', 1, V)
            at = [len(w.cand) for w in active]  # each row's next draft position (the step without forced tokens)
            tokens = self._sample(self._process(logits, active, at), active, sampling,
                                  offsets=[[o] for o in at])[:, 0].tolist()
            for w, t, x in zip(active, tokens, logits[:, 0]):
                # a level's logits are kept for the candidates before the first forced one
                if (w.cand_logits is not None and len(w.cand_logits) < self.tv_positions
                        and len(w.cand_logits) == len(w.cand)):
                    w.cand_logits.append(x.clone())
                w.cand.append(t)
                if w.forcing:
                    certain.extend(w)
            active = [w for w in active if more(w)]
            self.draft_step_done(step)
        for w in work:
            w.drafted[0] = certain.own_count(w, len(w.cand))
            w.proposal = list(w.cand)

    # -- one model's forward ----------------------------------------------------------------
    def _run_model(self, name: str, work: list[RowWork], sampling: SamplingTensors) -> None:
        """ONE forward of model `name` over the rows that verify with it and the rows that draft
        with it (their first step); then the drafting rows' remaining steps."""
        verify = [w for w in work if w.level(name) >= 1 or w.chain == (name,)]  # plain rows: level 0
        draft = [w for w in work if w.chain[0] == name and w.k > 0]
        rows = verify + draft
        if not rows:
            return
        trees = [w.tree if w.tree is not None and w.level(name) == 1 else None for w in verify] + [None] * len(draft)
        spec = [list(t.tokens) if t is not None else w.cand for w, t in zip(verify, trees)] + [[] for _ in draft]
        if name == self.target:
            self._prompt_logprobs(name, [w for w in verify if w.seq.params.prompt_logprobs is not None
                                         and w.seq.prompt_logprobs is None])
        logits = self._forward(name, rows, spec, trees)  # (B, n_max + 1, V)
        offsets = None
        if any(t is not None for t in trees):  # a tree node gives the token at start + depth + 1
            G = logits.shape[1]
            offsets = [token_offsets(t) + [0] * (G - len(t) - 1) if t is not None else list(range(G)) for t in trees]
        processed = self._process(logits, rows)  # after the rows' logits processors (never a tree row's)
        # (B, n_max + 1): the token each row samples there, as host lists (one read of the tensor)
        tokens = self._sample(processed, rows, sampling, offsets=offsets).tolist()
        if verify:
            if self.measure_tv:
                self._measure_tv(name, verify, logits[: len(verify)], sampling)
            chains = [i for i, t in enumerate(trees[: len(verify)]) if t is None]
            if len(chains) < len(verify):
                self._verify_trees(name, [(verify[i], tokens[i]) for i, t in enumerate(trees[: len(verify)]) if t is not None])
            if len(chains) == len(verify):
                self._verify(name, verify, tokens[: len(verify)], logits)
            elif chains:
                sel = torch.tensor(chains, dtype=torch.long)
                self._verify(name, [verify[i] for i in chains], [tokens[i] for i in chains], logits.index_select(0, sel))
            if name == self.target:
                self._logprobs(verify, processed, sampling)  # (no tree row asks: `_tree_ok`)
        if draft:
            first, first_logits = [t[0] for t in tokens[len(verify):]], logits[len(verify):, 0]  # (B', V)
            grow = [i for i, w in enumerate(draft) if w.tree_budget]
            chain = [i for i, w in enumerate(draft) if not w.tree_budget]
            if len(chain) == len(draft):
                self._draft_steps(name, draft, first, first_logits, sampling)
            elif chain:
                self._draft_steps(name, [draft[i] for i in chain], [first[i] for i in chain],
                                  first_logits[chain], sampling)
            if grow:  # tree rows grow their trees depth by depth (decoding/tree_drafting.py)
                for i in grow:
                    draft[i].cand_logits = [first_logits[i].clone()] if self.measures_tv(draft[i]) else None
                draft_tree(self, name, [draft[i] for i in grow], first_logits[grow])

    def _measure_tv(self, name: str, work: list[RowWork], logits: torch.Tensor, sampling: SamplingTensors) -> None:
        """Each row's mean D_TV between the level below (its `cand_logits`) and level `name`
        (`logits` (B, n + 1, V)) at its first `tv_positions` candidates, in one vectorised pass
        over the rows that have both (decoding/tv.py); its seconds are the step's `tv_seconds`."""
        idx = [i for i, w in enumerate(work) if w.cand and w.cand_logits
               and not w.seq.params.has_processors]
        if not idx:  # no row measures (greedy rows the router ignores, model-free drafts)
            return
        t0 = self.clock()
        # <= tv_positions; a tree row's: the root's only (the draft's root logits)
        drafts = [work[i].cand_logits[: min(len(work[i].cand), len(work[i].cand_logits))] for i in idx]
        tv = tv_rows(drafts, logits, idx, sampling, [work[i].b for i in idx])
        for i, d in zip(idx, tv):
            work[i].tv[work[i].level(name)] = d
        self._tv_seconds += self.clock() - t0

    def _verify(self, name: str, work: list[RowWork], tokens: list[list[int]], logits: torch.Tensor) -> None:
        """Level `name` verifies each row's candidates against its own tokens (B lists of n + 1,
        `verification.verify_rows`); what a row passes up carries this level's logits at its
        positions (`logits` (B', n + 1, V), the verifying rows first)."""
        for w_i, (w, out) in enumerate(zip(work, verify_rows([w.cand for w in work], tokens))):
            a = len(out) - 1  # candidates accepted
            j = w.level(name)
            if w.forced:
                certain.count(self.certain_counts, w, a)
            # the router's evidence: the drafters' own candidates (certain ones are no trial)
            w.drafted[j], w.accepted[j] = certain.own_count(w, len(w.cand)), certain.own_count(w, a)
            if j == len(w.chain) - 1:
                w.certain = a - w.accepted[j]
                if w.values:
                    certain.count_values(w.seq.grammar.fields, w.values, a)
                if w.forcing and self.field_drafts and w.seq.grammar.fields is not None:
                    w.seq.grammar.fields.gate.observe(w.contest, w.seq.tokens, out)  # their evidence
            certain.keep_prefix(w, a)
            if j == 1 and j < len(w.chain) - 1 and w.proposal is None and not w.forcing:
                w.proposal = list(out)  # a model-free drafter's verifier: its own tokens (RowWork.proposal)
            w.cand = out if j == len(w.chain) - 1 else out[: w.cap]  # the target's output is committed
            if w.forcing and j < len(w.chain) - 1:  # the next level's bonus falls after the forced tokens
                certain.extend(w)
            w.cand_logits = (list(logits[w_i, : min(len(w.cand), self.tv_positions)].clone())
                             if j < len(w.chain) - 1 and self.measures_tv(w) else None)

    def _verify_trees(self, name: str, rows: list[tuple[RowWork, torch.Tensor]]) -> None:
        """The target walks each row's token tree (decoding/tree.py `walk`) with its own tokens
        (root, then one per node), moves the accepted branch's KV to contiguous positions and
        keeps it as the row's speculative tokens (what `StateManager.commit` keeps)."""
        runner = self.runners[name]
        for w, toks in rows:
            tree, dt = w.tree, w.draft_tree
            target = toks[: len(tree) + 1]
            nodes, final = walk(tree, target)
            runner.move_kv(self.state.state(w.seq.seq_id, name).slot, w.start, nodes)
            self.state.state(w.seq.seq_id, name).speculative = [tree.tokens[i] for i in nodes]
            path = [w.tree_ids[i] for i in nodes]
            if dt is not None:  # a model drafter's tree: rank evidence for the shape policy
                w.ranks = dt.evidence(path, [target[0]] + [target[1 + i] for i in nodes])
            # the router's evidence stays the chain's: its main path, what of it was accepted
            main = set(dt.main_path() if dt is not None else tree.main_path())
            main_acc = 0
            while main_acc < len(path) and path[main_acc] in main:
                main_acc += 1
            w.drafted[1], w.accepted[1], w.tree_accepted = len(main & set(w.tree_ids)), main_acc, len(nodes)
            w.cand = [tree.tokens[i] for i in nodes] + [final]
            w.cand_logits = None

    def _choose(self, logits: torch.Tensor, work: list[RowWork], sampling: SamplingTensors, offset: int = 0,
                offsets: list[list[int]] | None = None) -> torch.Tensor:
        """(B, G) tokens the rows sample at logit positions g = 0..G-1, i.e. at sequence
        positions start + offset + g (or start + offsets[b][g]: a tree's nodes) (greedy rows: argmax; others: counter-based noise), after
        the rows' logits processors, whose history at position g is the committed tokens plus
        w.cand[: offset + g] (the draft path: the same at every level)."""
        return self._sample(self._process(logits, work, offset), work, sampling, offset, offsets)

    def _process(self, logits: torch.Tensor, work: list[RowWork], offset: int | list[int] = 0) -> torch.Tensor:
        """`logits` (B, G, V) after the rows' logits processors (processors.py; itself when no
        row has any), the history at position g being the committed tokens plus
        w.cand[: offset + g] (`offset`: one for every row, or one per row). Its seconds and rows are the step's `processor_seconds` / `_rows`
        (the router charges them per row-forward)."""
        rows = sum(1 for w in work if w.processors)
        if not rows:
            return logits
        eager = [w.processors and not lazy(w) for w in work]  # lazy rows: `_sample` masks them (lazy_mask.py)
        if not any(eager):
            self._proc_rows += rows
            return logits
        t0 = self.clock()
        for w, e in zip(work, eager):
            if e and w.seq.penalty_memo is None:
                w.seq.penalty_memo = PenaltyMemo()
        offsets = offset if isinstance(offset, list) else [offset] * len(work)
        on_host = logits.device.type == "cpu"  # penalties etc. run on host tensors
        # in place: the forward's logits of a row with processors are read processed from here on
        out = process_rows(logits if on_host else logits.cpu(), [
            RowHistory(w.seq.params, w.seq.tokens, w.seq.prompt_len, w.seq.stop_ids, w.cand, o,
                       w.seq.grammar, w.seq.penalty_memo) if e else None
            for w, o, e in zip(work, offsets, eager)], inplace=True)
        if not on_host:
            out = out.to(logits.device)
        self._proc_seconds += self.clock() - t0
        self._proc_rows += rows
        return out

    def _sample(self, logits: torch.Tensor, work: list[RowWork], sampling: SamplingTensors, offset: int = 0,
                offsets: list[list[int]] | None = None) -> torch.Tensor:
        """`_choose` on logits already processed (`_process`): (B, G) host tokens
        (`sampling.choose_at`: one native call on the CPU); a greedy row whose only processor is
        its grammar was left unprocessed and is masked here only where the grammar refuses its
        token (decoding/lazy_mask.py)."""
        positions = [] if sampling.all_greedy else token_positions(work, logits.shape[1], offset, offsets)
        tokens = choose_at(logits, sampling, [w.b for w in work], [w.seq.seed_key for w in work], positions)
        rows = [b for b, w in enumerate(work) if lazy(w)]
        if rows:  # greedy rows whose only processor is the grammar: masked where it refuses their token
            t0 = self.clock()
            choose_refused(logits, work, sampling, rows, offset, offsets, tokens)
            self._proc_seconds += self.clock() - t0
        return tokens

    # -- log-probabilities (decoding/logprobs.py) -------------------------------------------
    def _logprobs(self, work: list[RowWork], processed: torch.Tensor, sampling: SamplingTensors) -> None:
        """The target's logprobs of what each row asking for them commits (`w.cand` after the
        target verified: its positions 0..len - 1 of `processed` (B', n + 1, V), the target's
        logits after the rows' processors, the verifying rows first)."""
        idx = [i for i, w in enumerate(work) if w.seq.params.logprobs is not None]
        if not idx:
            return
        G = max(len(work[i].cand) for i in idx)
        rows = torch.tensor([work[i].b for i in idx], dtype=torch.long, device=sampling.temperature.device)
        tokens = torch.tensor([work[i].cand + [0] * (G - len(work[i].cand)) for i in idx],
                              dtype=torch.long, device=processed.device).view(len(idx), G)
        entries = generated_logprobs(processed[idx, :G], sampling.select(rows), tokens,
                                     [work[i].seq.params.logprobs for i in idx])
        for i, e in zip(idx, entries):
            work[i].logprobs = e[: len(work[i].cand)]

    PROMPT_CHUNK = 512  # prompt positions per forward of `_prompt_logprobs` (bounds its logits' memory)

    def _prompt_logprobs(self, name: str, work: list[RowWork]) -> None:
        """Rows asking for prompt logprobs, at their first cycle: the target prefills all but the
        last committed token in forwards of their own (PROMPT_CHUNK positions each) that return
        every position's logits (a prefix-cache hit is recomputed: those logits were never
        kept); the main forward then feeds the last token as usual."""
        for w in work:
            st = self.state.state(w.seq.seq_id, name)
            tokens = w.seq.tokens[: w.seq.prompt_len]
            StateManager.rollback(st, 0)
            if st.features:  # the target's features follow its cache (state/features.py)
                st.features = 0
            entries = []
            for s in range(0, len(tokens) - 1, self.PROMPT_CHUNK):
                e = min(s + self.PROMPT_CHUNK, len(tokens) - 1)
                batch = ForwardBatch.build([st.slot], [s], [tokens[s:e]], [list(range(e - s))])
                logits = self._timed_forward(name, batch, 1, e - s, s)  # (1, e - s, V)
                entries += prompt_logprobs(logits[0], torch.tensor(tokens[s + 1 : e + 1], device=logits.device),
                                           w.seq.params.prompt_logprobs)
                st.cache_len = e
            w.prompt_logprobs = entries

    # -- forwards ---------------------------------------------------------------------------
    def _forward(self, name: str, work: list[RowWork], speculative: list[list[int]],
                 trees: list[TokenTree | None] | None = None) -> torch.Tensor:
        """Feed each row's pending tokens plus `speculative[b]` to model `name`; return logits at
        the last pending position and at every speculative one: (B, max_spec + 1, V).
        With a head in the pool, the target's forward keeps its features when a row drafts
        with a head (head_drafting.py)."""
        state = self.state
        keep = None  # None: no head in the pool, nothing to track
        if self.heads and name == self.target:
            keep = any(w.chain[0] in self.heads for w in work)
            if keep:
                refeed_gaps(self, work)
        slots, starts, feeds, positions, states = [], [], [], [], []
        for w, spec in zip(work, speculative):
            st = state.state(w.seq.seq_id, name)
            pending = w.seq.tokens[st.cache_len :]
            slots.append(st.slot)
            starts.append(st.cache_len)
            feeds.append(pending + spec)
            first = len(pending) - 1
            positions.append(list(range(first, first + len(spec) + 1)))
            state.fed(st, w.seq.tokens, list(spec))
            states.append(st)
        parents = None
        if trees is not None and any(t is not None for t in trees):  # tree rows: their nodes' parents
            parents = [feed_parents(len(f) - len(s), t) if t is not None else list(range(-1, len(f) - 1))
                       for f, s, t in zip(feeds, speculative, trees)]
        batch = ForwardBatch.build(slots, starts, feeds, positions, parents=parents)
        width = self._width(name, batch, len(work))
        context = sum(starts) // len(starts)
        if keep is None:
            return self._timed_forward(name, batch, len(work), width, context)
        if keep:
            runner = self.runners[name]
            logits, features = self._timed(name, batch, len(work), width, context,
                                           lambda: runner.forward_with_features(batch))
            self.state.features.ensure(runner.num_slots, runner.max_len)
            self.state.features.write(batch, features)
            logits = cut(logits, self.vocab_width)
        else:
            logits = self._timed_forward(name, batch, len(work), width, context)
        for st, start, feed in zip(states, starts, feeds):
            st.features = after_forward(st.features, start, start + len(feed), keep)
        return logits

    def _timed_head(self, name: str, batch: ForwardBatch, features: torch.Tensor, rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft head's step, timed like a forward: (logits (B, G, vocab_width), predicted
        features (B, T, H))."""
        logits, predicted = self._timed(name, batch, rows, self._width(name, batch, rows), None,
                                        lambda: self.runners[name].step(batch, features))
        return cut(logits, self.vocab_width), predicted

    def _width(self, name: str, batch: ForwardBatch, rows: int) -> float:
        """The new tokens a forward of `batch` costs per row: its widest row, or the mean of
        its valid tokens where the runner packs them (`packs_ragged`)."""
        return sum(batch.num_tokens_list) / rows if self.runners[name].packs_ragged else batch.tokens.shape[1]

    def _timed_forward(self, name: str, batch: ForwardBatch, rows: int, width: float, context: int | None = None) -> torch.Tensor:
        logits = self._timed(name, batch, rows, width, context, lambda: self.runners[name].forward(batch))
        return cut(logits, self.vocab_width)

    def _timed(self, name: str, batch: ForwardBatch, rows: int, width: float, context: int | None, call):
        """`call()`'s result, its seconds recorded as a forward of model `name` over `batch`."""
        t0 = self.clock()
        out = call()
        device = self.runners[name].device
        if str(device) != "cpu":
            synchronize(device)  # a GPU's forward is timed to its end
        dt = self.clock() - t0
        self._ftime[name] = self._ftime.get(name, 0.0) + dt
        self._fsum += dt
        self._ftoks[name] = self._ftoks.get(name, 0) + sum(batch.num_tokens_list)
        if context is None:
            context = sum(batch.starts_list) // rows
        self._forwards.append(ForwardRecord(model=name, rows=rows, new_tokens=width, context_len=context, seconds=dt))
        return out

    # -- commit -----------------------------------------------------------------------------
    def _result(self, work: list[RowWork], t_start: float) -> StepResult:
        """Commit every row's target output; per-row outcomes and per-chain summaries."""
        outcomes, proposals, groups = [], [], {}
        for w in work:
            seq = w.seq
            kept = seq.append(w.cand)  # the target's output (stop tokens / max_new_tokens truncate)
            if w.logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.extend(w.logprobs[:kept])
            if w.prompt_logprobs is not None:
                seq.prompt_logprobs = w.prompt_logprobs
            self.state.commit(seq.seq_id, seq.tokens, w.start)
            seq.stats.observe_cycle(w.chain, w.drafted, w.accepted, len(seq.tokens) - w.start)
            certain_kept = min(w.certain, kept)
            seq.stats.certain += certain_kept
            outcomes.append(RowOutcome(seq_id=seq.seq_id, chain=w.chain, k=w.k, drafted=list(w.drafted),
                                       accepted=list(w.accepted), greedy=seq.params.greedy,
                                       context_len=w.start, tv=list(w.tv) if self.measure_tv else None,
                                       certain=certain_kept,
                                       caught_up=caught_up_trials(w.caught, seq.tokens) if w.caught else ()))
            proposals.append(w.proposal or [])
            groups.setdefault(w.chain, []).append((w, len(w.cand)))
        wall = self.clock() - t_start
        cycles = []
        for i, (chain, members) in enumerate(groups.items()):
            cycles.append(CycleStats(
                chain=chain, k=max(w.k for w, _ in members), rows=len(members),
                drafted=[sum(w.drafted[j] for w, _ in members) for j in range(len(chain))],
                accepted=[sum(w.accepted[j] for w, _ in members) for j in range(len(chain))],
                committed=sum(m for _, m in members),
                forward_time=dict(self._ftime) if i == 0 else {},
                forward_tokens=dict(self._ftoks) if i == 0 else {},
                wall_time=wall if i == 0 else 0.0,
                row_ids=[w.seq.seq_id for w, _ in members],
                row_proposal=([w.proposal for w, _ in members]
                              if all(w.proposal for w, _ in members) else []),
            ))
        trees = [TreeOutcome(seq_id=w.seq.seq_id, nodes=len(w.tree), width=w.tree_width,
                             main=w.drafted[1], accepted=w.tree_accepted, main_accepted=w.accepted[1],
                             ranks=w.ranks, children=w.tree_children or w.tree_width)
                 for w in work if w.tree is not None]
        return StepResult(outcomes=outcomes, proposals=proposals, forwards=self._forwards, cycles=cycles,
                          forward_time=dict(self._ftime), wall_time=wall,
                          speculative=any(w.k > 0 for w in work), tv_seconds=self._tv_seconds,
                          draft_steps=self._steps_drafted, draft_host_seconds=self._draft_host,
                          processor_seconds=self._proc_seconds, processor_rows=self._proc_rows, trees=trees)
