"""Step 3 of a decision (policy.py): bounded probing, optimism under uncertainty within a budget.

Pairs with little (or faded) evidence (`SimilarityEstimator.needs_probe`) get their optimistic alpha
(a Wilson upper bound), and models read slow (speed > `probe_slow_speed` x their usual speed,
`CostProfile.usual`) and not timed for `probe_slow_after` row-cycles their usual speed (a draft read
13.7x slow in one stalled cycle was priced out of every plan, so never timed again, and waited for
`stale_after`, 200 row-cycles, to be re-probed at its swept speed); when the `ProbeBudget` allows
(5% of row-cycles, 2% of wall time) and a chain measuring one of them could beat the plan in that
optimistic world, one cycle runs it (the most promising first), at its best k up to `probe_k`; its
expected extra cost over the plan is charged to the budget when it is chosen, and replaced by its
realised extra cost once the cycle is observed alone (`settle`: the cycle's seconds less the plan's
predicted seconds for the tokens it committed; charging it as predicted was
`RouterConfig.probe_charge_realized=False`, removed by prune23, issue 27). The optimism
that makes a probe worth running also predicts it nearly free: charged as predicted, chat's probes
with penalties (a draft agreeing on 0-17% of tokens, predicted ~30%; a first draft cycle in a
request also prefills the draft, 77 ms against 36 predicted) never reached the 2% time cap. A pair
is probed by a chain it starts (`first_pair_chains`: its drafter drafts, its verifier verifies every
candidate): behind a model-free drafter a miss teaches nothing, and behind another model it sees
only what that level passed up, so a pair whose early trials went badly was "probed" for a whole
stream without a trial (measured: at t=0.7 the draft>target pair stuck at alpha 0.17 after 4 early
rejections, probed only through ngram>draft>target, where draft>target k=2 ran 1.15x target-only). A
probe that taught nothing about its pair (a model-free miss) doubles the wait before that pair's
next one, so refuted pairs stop being probed until their evidence fades.

A refutation keeping the pair from every request's probes as well was
`RouterConfig.probe_refute_global` (floor19; off, removed by prune22, issue 27).

A probe of a model pair always adds trials, so that back-off never started for one: a chat
request with penalties probed the draft 1-3 times (+12-36 ms each over a ~20 ms plain step, on
a Zen 1) though each probe's draft agreed as rarely as before. So a probe is also judged by
what it showed (`judge`): when its pair's trials in that cycle accepted no more than the
request's own estimate of the pair when it was chosen (the optimism that chose it refuted), the
request does not probe that pair for `RouterConfig.probe_refute_wait` of its cycles, doubled at
each further refutation; a probe that accepted more sets no wait. Per request: another request
(code against chat) is probed as before.
"""

from __future__ import annotations

import numpy as np

from specrouter.records.routing import Decision, Pair, RowContext, RowOutcome
from specrouter.router.cost_model import best_plan
from specrouter.router.evidence import decision_z
from specrouter.router.host_time import PlainCharge
from specrouter.router.similarity import ProbeBudget, acceptance_trials


class Prober:
    """The probing of one `Router` (module docstring): its budget and back-off state."""

    def __init__(self, router):
        cfg = router.config
        self.router = router  # policy.Router: chains, estimates, plan tables
        self.budget = ProbeBudget(cfg.probe_fraction, cfg.probe_time_fraction)
        self.next_check = 0  # row-cycle from which a probe is worth computing again
        self.probes: dict[Pair, tuple[int, float, int]] = {}  # pair -> (row-cycle, trials then, back-off)
        self.model_seen: dict[str, int] = {}  # row-cycle each model was last timed
        self.slow_waits: dict[str, int] = {}  # model read slow -> row-cycles before its next re-probe (`_slow`)
        # seq_id -> (the plan's seconds per token, the probe's predicted extra seconds, the
        # router's seconds per cycle it was predicted with) of a probe not yet observed
        self.pending: dict[int, tuple[float, float, float]] = {}
        # seq_id -> (the pair probed, the request's estimate of it then) of a probe not yet judged
        self.testing: dict[int, tuple[Pair, float]] = {}

    def due(self) -> bool:
        """May this decision probe (the budget allows, and the last look found no probe long
        enough ago)?"""
        return self.budget.allow() and self.router.similarity.now >= self.next_check

    def decide(self, row: RowContext, req, mode: str, k_cap: int, decision: Decision, plans) -> Decision:
        """A probe instead of `decision` this one cycle, within the budget (the request's plan
        stays as it is); else `decision`. `plans`: the row's step 1 (evidence.py `CachedPlans`,
        its key holds: the costs, estimates and router seconds `Router.inputs` gives now), whose
        charge weighs a plain plan against the probes with both kinds' host seconds (policy.py,
        step 2)."""
        router = self.router
        costs, alphas, overhead, charge = plans.costs, plans.alphas, plans.overhead, plans.charge
        probe = self._probe(mode, decision.chain, decision.t_eff, costs, alphas, overhead, k_cap, charge, req,
                            router.board.rows_for(row, overhead))
        if probe is None:
            self.next_check = router.similarity.now + router.config.probe_recheck
            return decision
        pi, pk = probe
        chain = router.chains[pi]
        times = router.board.current().times
        one = best_plan([chain], pk, costs=costs, alphas=alphas, overhead=times["spec"] + overhead,
                        draft_step_overhead=times["draft_step"]).table  # as now estimated
        latency, tokens = float(one.expected_latency[0, pk - 1]), float(one.expected_tokens[0, pk - 1])
        extra = latency - decision.t_eff * tokens
        self.budget.charge(extra)
        self.pending[row.seq_id] = (decision.t_eff, extra, overhead)
        if router.config.probe_refute_wait > 0:  # judged against its estimate without the decision margin
            pair = chain[:2]
            estimate = alphas[pair] if decision_z(router.config, mode) <= 0.0 or req is None else \
                round(router.alpha(pair, mode, req), router.config.alpha_decimals)
            self.testing[row.seq_id] = (pair, estimate)
        return Decision(chain, pk, latency / tokens, "probe",
                        router.confidence_floor(chain, pk, latency / tokens, costs))

    def settle(self, seq_id: int, wall_time: float | None = None, tokens: int = 0) -> None:
        """The cycle of a probe of `seq_id` was observed: its charge becomes its realised extra
        seconds over the plan, the cycle's `wall_time` plus the router's seconds it was predicted
        with, less the plan's seconds per token for the `tokens` it committed. `wall_time` None
        (a batch's step, whose seconds are not one row's): the predicted charge stays."""
        pending = self.pending.pop(seq_id, None)
        if pending is None or wall_time is None or not wall_time > 0.0:
            return
        t_plan, predicted, router_seconds = pending
        self.budget.settle(predicted, wall_time + router_seconds - t_plan * tokens)

    def judge(self, req, outcome: RowOutcome) -> None:
        """A probe of `req` was observed (`outcome`, its row's cycle): its pair's trials there
        accepted no more than the request's estimate when it was chosen (refuted: the pair
        waits `probe_refute_wait` of the request's cycles, or twice its last wait), or more (no
        wait). A cycle without a trial of the pair (a model-free miss, another chain) leaves it."""
        probe = self.testing.pop(outcome.seq_id, None)
        chain = tuple(outcome.chain)
        if probe is None or chain[:2] != probe[0]:
            return
        pair, estimate = probe
        a, rej = acceptance_trials(int(outcome.drafted[1]), int(outcome.accepted[1]),
                                   outcome.k if pair[0] in self.router.model_free else None)
        if a + rej == 0:
            return
        cfg = self.router.config
        if a / (a + rej) > estimate:
            return  # not refuted: no wait (a one-trial probe's lucky acceptance does not reset the doubling)
        last = req.probe_waits.get(pair)
        wait = max(cfg.probe_refute_wait, 2 * last[1] if last is not None else 0)
        req.probe_waits[pair] = (req.cycles + wait, wait)

    def _probe(self, mode: str, running, t_plan: float, costs, alphas, overhead: float,
               k_cap: int, charge: PlainCharge = PlainCharge(), req=None, rows: dict | None = None
               ) -> tuple[int, int] | None:
        """(chain index, k) of a probe, or None (module docstring). A candidate pair is worth a
        probe when some chain measuring it beats the plan (T_eff below `t_plan`) in the
        optimistic world, a plain plan with `charge` on both sides; the most promising one goes,
        with its best chain at that chain's best k up to `probe_k`. `req`: the request's pairs
        waiting after a refuting probe (`judge`) are not candidates. `rows`: the row's PlanTable
        rows already evaluated on these costs (`EvidenceBoard.rows_for`), shared: a chain's row is keyed by
        the estimates it reads, so the optimistic world's chains are evaluated once (not where a
        slow model is priced at its usual speed: other costs)."""
        router = self.router
        cfg, sim, now = router.config, router.similarity, router.similarity.now
        waits = {p for p, (until, _) in req.probe_waits.items() if req.cycles < until} if req is not None else set()
        busy = set(zip(running[:-1], running[1:]))
        slow = self._slow(now)
        prof = router.profile
        candidates = [p for p in router.pairs if p not in busy and p not in waits
                      and (sim.needs_probe(p, mode) or slow.intersection(p))
                      and now >= self._ready(p, mode)]
        if not candidates:
            return None
        hopeful = dict(alphas)
        for p in candidates:
            if sim.needs_probe(p, mode):
                hopeful[p] = max(alphas[p], round(sim.upper(p, mode, cfg.probe_optimism), cfg.alpha_decimals))
                for t in router.triples:  # confirmed tokens (cost_model.py, 4) are at least as hopeful
                    if t[1:] == p:
                        hopeful[t] = max(alphas[t], hopeful[p])
        hopeful_costs = dict(costs)
        for m in slow:  # it may have recovered while nobody looked: at its usual speed
            if isinstance(costs[m], np.ndarray):
                hopeful_costs[m] = costs[m] * prof.usual(m) / prof.speed(m)
        probed = {p: self.first_pair_chains(p) for p in candidates}  # the chains a probe may run
        table = router.table(hopeful_costs, hopeful, overhead, k_cap, rows=None if slow else rows,
                             only={i for chains in probed.values() for i in chains})
        t = table.t_eff  # (C, K)
        if len(running) == 1 and charge.nonzero:  # a plain plan: both kinds' host seconds
            t_plan += charge.plain
            t = charge.t_eff(table)
        best = None  # (optimistic T_eff, pair, chain index, k index)
        for p in candidates:
            for i in probed[p]:
                j = int(np.argmin(t[i]))
                if t[i, j] < t_plan and (best is None or t[i, j] < best[0]):
                    best = (float(t[i, j]), p, i, j)
        if best is None:
            return None
        _, p, i, j = best
        for m in slow.intersection(router.chains[i]):  # read slow again, it waits twice as long
            self.slow_waits[m] = 2 * self.slow_waits.get(m, cfg.probe_slow_after)
        last = self.probes.get(p)
        wait = 0 if last is None or self._taught(p, mode, last) else max(2 * last[2], cfg.probe_recheck)
        longest = int(cfg.probe_max_wait * sim.config.stale_after)
        self.probes[p] = (now, sim.stats(p, mode).trials, min(wait, longest))
        return i, min(j + 1, cfg.probe_k)

    def _slow(self, now: int) -> set[str]:
        """The models read slower than usual (`probe_slow_speed` x `CostProfile.usual`) and not
        timed for their wait: `probe_slow_after` row-cycles, doubled at each probe that ran
        one of them (a model that stays slow is re-tried at 16, 32, 64, ... row-cycles; one read
        at its usual speed again starts afresh)."""
        router, prof = self.router, self.router.profile
        threshold, first = router.config.probe_slow_speed, router.config.probe_slow_after
        slow = set()
        for m in router.order:
            if m not in prof:
                continue
            if prof.speed(m) <= threshold * prof.usual(m):
                self.slow_waits.pop(m, None)
            elif now - self.model_seen.get(m, 0) >= self.slow_waits.get(m, first):
                slow.add(m)
        return slow

    def first_pair_chains(self, pair: Pair) -> list[int]:
        """Indices of the chains that start with `pair` (module docstring); every chain that
        measures it when none does."""
        chains, measuring = self.router.chains, self.router.pair_chains[pair]
        return [i for i in measuring if chains[i][:2] == pair] or measuring

    def _taught(self, pair: Pair, mode: str, last: tuple[int, float, int]) -> bool:
        return self.router.similarity.stats(pair, mode).trials > last[1] + 0.5

    def _ready(self, pair: Pair, mode: str) -> int:
        """Row-cycle from which the pair may be probed again: at once if its last probe taught
        something, else after twice the previous wait (back-off)."""
        last = self.probes.get(pair)
        if last is None or self._taught(pair, mode, last):
            return 0
        return last[0] + max(2 * last[2], self.router.config.probe_recheck)
