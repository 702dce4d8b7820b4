"""The chain executor: one cycle of multi-level speculative decoding for a batch of rows that
run the same chain and draft length (DESIGN.md pillar 2).

1. M1 drafts k tokens (k forwards of a small model, or one model-free lookup), keeping its
   processed distribution at each drafted position.
2. Every later level Mj feeds its pending tokens plus the candidates that reached it in ONE
   forward and verifies them against the proposal distribution of the level below
   (`verification.py`); what it accepted plus its recovered/bonus token, with its own
   distributions, is the proposal for the level above.
3. The target's output is committed (truncated at stop tokens / max_new_tokens) and every model
   keeps the prefix of what it cached that was committed (`StateManager.commit`).

Rows are ragged everywhere: different prompt lengths, pending catch-up, candidates per level.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specrouter.config import MAX_DRAFT_LENGTH
from specrouter.decoding.drafters.base import ModelFreeDrafter
from specrouter.decoding.sampling import SamplingTensors, process_logits, sample
from specrouter.decoding.verification import (
    LevelResult,
    verify_greedy,
    verify_speculative,
)
from specrouter.engine.stats import CycleStats
from specrouter.models.runners.base import ForwardBatch, ModelRunner
from specrouter.router.records import ForwardRecord
from specrouter.router.similarity import candidate_tv
from specrouter.state.manager import StateManager
from specrouter.state.sequence import Sequence


class ChainExecutor:
    """Runs cycles over a pool of runners and model-free drafters that share one vocabulary.

    `vocab_width` is the common logits width: logits of every model are cut to it, at every
    level and in target-only decoding alike, so the target's distribution is the same either way.
    """

    def __init__(
        self,
        runners: dict[str, ModelRunner],
        drafters: dict[str, ModelFreeDrafter],
        state: StateManager,
        vocab_width: int,
        clock=time.perf_counter,
    ):
        self.runners = runners
        self.drafters = drafters
        self.state = state
        self.vocab_width = vocab_width
        self.clock = clock  # timing source (tests inject a virtual clock)

    # -- forwards ---------------------------------------------------------------------------
    def _forward(
        self,
        name: str,
        rows: list[Sequence],
        speculative: list[list[int]],
        stats: dict[str, float],
        tokens_fed: dict[str, int],
    ) -> torch.Tensor:
        """Feed each row's pending tokens plus `speculative[b]` to model `name`; return logits at
        the last pending position and at every speculative one: (B, max_spec + 1, V)."""
        state = self.state
        slots, starts, feeds, positions = [], [], [], []
        for seq, spec in zip(rows, speculative):
            st = state.state(seq.seq_id, name)
            pending = seq.tokens[st.cache_len :]
            slots.append(st.slot)
            starts.append(st.cache_len)
            feeds.append(pending + spec)
            first = len(pending) - 1
            positions.append(list(range(first, first + len(spec) + 1)))
            state.fed(st, seq.tokens, list(spec))
        batch = ForwardBatch.build(slots, starts, feeds, positions)
        runner = self.runners[name]
        t0 = self.clock()
        logits = runner.forward(batch)
        dt = self.clock() - t0
        stats[name] = stats.get(name, 0.0) + dt
        tokens_fed[name] = tokens_fed.get(name, 0) + sum(batch.num_tokens_list)
        self._forwards.append(ForwardRecord(model=name, rows=len(rows), new_tokens=batch.tokens.shape[1],
                                            context_len=sum(starts) // len(starts), seconds=dt))
        return logits[..., : self.vocab_width]

    def _draft_model(
        self,
        name: str,
        rows: list[Sequence],
        k: int,
        sampling: SamplingTensors,
        generator: torch.Generator | None,
        ftime: dict[str, float],
        ftoks: dict[str, int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k autoregressive steps of a draft model: tokens (B, k) and, when sampling, its
        processed distributions (B, k, V)."""
        runner = self.runners[name]
        B = len(rows)
        # step 0 feeds the pending tokens (catch-up); the last draft token is never fed
        logits = self._forward(name, rows, [[] for _ in rows], ftime, ftoks)  # (B, 1, V)
        states = [self.state.state(s.seq_id, name) for s in rows]
        slots = torch.tensor([st.slot for st in states], dtype=torch.long)
        slots_list = slots.tolist()
        ones = torch.ones(B, dtype=torch.long)
        zeros = torch.zeros(B, 1, dtype=torch.long)
        tokens, probs = [], []
        steps_time, context = 0.0, sum(st.cache_len for st in states) // B
        for i in range(k):
            if sampling.all_greedy:
                tok = logits[:, 0].argmax(dim=-1)  # (B,)
            else:
                p = process_logits(logits, sampling)  # (B, 1, V)
                tok = sample(p, generator)[:, 0]
                probs.append(p[:, 0])
            tokens.append(tok)
            if i == k - 1:
                break
            tok_list = tok.tolist()
            starts_list = []
            for st, t in zip(states, tok_list):
                starts_list.append(st.cache_len + len(st.speculative))
                st.speculative.append(t)
            batch = ForwardBatch(
                slots=slots, starts=torch.tensor(starts_list, dtype=torch.long),
                tokens=tok[:, None], num_tokens=ones, logit_positions=zeros,
                slots_list=slots_list, starts_list=starts_list, num_tokens_list=[1] * B,
            )
            t0 = self.clock()
            logits = runner.forward(batch)[..., : self.vocab_width]
            dt = self.clock() - t0
            ftime[name] += dt
            ftoks[name] += B
            steps_time += dt
        if k > 1:
            self._forwards.append(ForwardRecord(model=name, rows=B, new_tokens=1, context_len=context,
                                                seconds=steps_time, count=k - 1))
        draft = torch.stack(tokens, dim=1)  # (B, k)
        return draft, (torch.stack(probs, dim=1) if probs else None)

    def _room(self, rows: list[Sequence], chain: tuple[str, ...]) -> int:
        """The longest draft every row's caches can hold: k drafted tokens reach position
        len(tokens) + k - 1 at a verifier (the draft model stops one short). Near the end of
        the context k shrinks to this, so a request never reserves positions for drafting."""
        max_len = min((self.runners[m].max_len for m in chain if m in self.runners), default=0)
        return max_len - max(len(s.tokens) for s in rows) if max_len else MAX_DRAFT_LENGTH

    # -- one cycle --------------------------------------------------------------------------
    def cycle(
        self,
        rows: list[Sequence],
        chain: tuple[str, ...],
        k: int,
        sampling: SamplingTensors,
        generator: torch.Generator | None = None,
    ) -> CycleStats:
        """One cycle of `chain` with draft length `k` for `rows`; commits >= 1 token per row."""
        t_start = self.clock()
        self._forwards: list[ForwardRecord] = []
        B = len(rows)
        greedy = sampling.all_greedy
        num_before = [len(s.tokens) for s in rows]
        # a row that may generate r more tokens gains nothing from more than r-1 candidates
        caps = torch.tensor([max(0, s.remaining - 1) for s in rows], dtype=torch.long)
        k_eff = min(k, int(caps.max()), self._room(rows, chain)) if len(chain) > 1 else 0
        levels = chain if k_eff > 0 else chain[-1:]
        ftime: dict[str, float] = {}
        ftoks: dict[str, int] = {}
        zero = torch.zeros(B, dtype=torch.long)
        drafted = [zero] * len(chain)  # per level: (B,) tokens drafted / candidates reaching it
        accepted = [zero] * len(chain)  # per level: (B,) candidates it accepted
        tv = [None] * len(chain)  # per level: (B,) mean D_TV(level below, level) at candidates (sampling)
        offset = len(chain) - len(levels)  # stats index of levels[0]

        # 1. draft
        cand = torch.zeros(B, 0, dtype=torch.long)  # (B, n) candidates for the next level
        num_cand = torch.zeros(B, dtype=torch.long)  # (B,) valid candidates per row
        draft_probs: torch.Tensor | None = None  # (B, n, V) their proposal distributions
        verify_from = 0
        proposals: list[list[int]] = []  # a model drafter's greedy proposals, per row
        if k_eff > 0:
            drafter = levels[0]
            verify_from = 1
            if drafter in self.drafters:
                t0 = self.clock()
                cand, num_cand = self.drafters[drafter].propose([s.tokens for s in rows], k_eff)
                ftime[drafter] = self.clock() - t0
                self._forwards.append(ForwardRecord(model=drafter, rows=B, new_tokens=k_eff,
                                                    context_len=sum(num_before) // B, seconds=ftime[drafter]))
                if not greedy:
                    draft_probs = F.one_hot(cand, self.vocab_width).to(torch.float32)
            else:
                cand, draft_probs = self._draft_model(drafter, rows, k_eff, sampling, generator, ftime, ftoks)
                num_cand = torch.full((B,), k_eff, dtype=torch.long)
                if greedy:
                    proposals = cand.tolist()
            num_cand = torch.minimum(num_cand, caps)
            drafted[0] = num_cand

        # 2. verify, level by level
        res: LevelResult | None = None
        for j in range(verify_from, len(levels)):
            name = levels[j]
            n = int(num_cand.max()) if num_cand.numel() else 0
            cand = cand[:, :n]
            cand_lists = [c[:m] for c, m in zip(cand.tolist(), num_cand.tolist())]
            logits = self._forward(name, rows, cand_lists, ftime, ftoks)  # (B, n+1, V)
            if greedy:
                res = verify_greedy(cand, num_cand, logits)
            else:
                verifier_probs = process_logits(logits, sampling)
                if draft_probs is None:  # no candidates anywhere: plain sampling
                    draft_probs = verifier_probs[:, :0]
                else:
                    draft_probs = draft_probs[:, :n].to(verifier_probs.dtype)
                if n > 0:
                    tv[offset + j] = candidate_tv(draft_probs, verifier_probs, num_cand)
                res = verify_speculative(cand, num_cand, draft_probs, verifier_probs, generator)
            drafted[offset + j] = num_cand
            accepted[offset + j] = res.num_accepted
            cand, num_cand, draft_probs = res.tokens, torch.minimum(res.lengths, caps), res.probs

        # 3. commit
        assert res is not None
        committed = 0
        drafted_rows = torch.stack(drafted, dim=1).tolist()  # (B, L)
        accepted_rows = torch.stack(accepted, dim=1).tolist()  # (B, L)
        ran = chain if k_eff > 0 else levels
        for b, (seq, toks, m) in enumerate(zip(rows, res.tokens.tolist(), res.lengths.tolist())):
            committed += m
            seq.append(toks[:m])
            self.state.commit(seq.seq_id, seq.tokens, num_before[b])
            seq.stats.observe_cycle(
                ran, drafted_rows[b][-len(ran):], accepted_rows[b][-len(ran):],
                len(seq.tokens) - num_before[b],
            )
        nan = float("nan")
        tv_rows = [[nan if t is None else float(t[b]) for t in tv[-len(ran):]] for b in range(B)]
        return CycleStats(
            chain=tuple(ran), k=k_eff, rows=B,
            row_ids=[s.seq_id for s in rows],
            row_k=torch.minimum(caps, torch.tensor(k_eff)).tolist() if k_eff > 0 else [0] * B,
            row_drafted=[d[-len(ran):] for d in drafted_rows],
            row_accepted=[a[-len(ran):] for a in accepted_rows],
            row_context=num_before,
            row_tv=tv_rows,
            row_proposal=proposals,
            forwards=self._forwards,
            drafted=[int(x.sum()) for x in drafted[-len(ran):]],
            accepted=[int(x.sum()) for x in accepted[-len(ran):]],
            committed=committed, forward_time=ftime, forward_tokens=ftoks,
            wall_time=self.clock() - t_start,
        )
