"""The batch planner's host-time savings change no decision (router/batch.py
`BatchPlanner.step_seconds`'s memo): a scripted serving run (rows joining and leaving at a
varying concurrency, acceptance drawn from a seeded generator, forwards timed by the scripted
costs, a deterministic timer) plans exactly the same batches with the memo on and off."""

from __future__ import annotations

import itertools
import random

import pytest
from fixtures import iid_cycle

from specrouter.config import RouterConfig
from specrouter.records.routing import ForwardRecord, RowContext, RowOutcome, StepReport, speculates
from specrouter.router.batch import BatchPlanner
from specrouter.router.policy import Router
from specrouter.router.profile import CostProfile
from specrouter.router.similarity import GREEDY

COSTS = {  # seconds of one forward: (b rows, t new tokens, context L): speculation wins below 4 rows
    "ngram": lambda b, t, L: 3e-5 * b + 1e-6 * t * b,
    "d1": lambda b, t, L: 0.002 + 0.0001 * b * t + 1e-7 * L * b,
    "T": lambda b, t, L: 0.040 + 0.008 * b * t + 2e-6 * L * b,
}
ALPHAS = {("d1", "T"): 0.75, ("ngram", "T"): 0.6, ("ngram", "d1"): 0.6}


def build_router(config: RouterConfig | None = None) -> Router:
    profile = CostProfile()
    for name, fn in COSTS.items():
        profile.set_function(name, fn, batch_sizes=(1, 2, 4, 8), new_tokens=(1, 2, 4, 8, 16),
                             context_lengths=(128, 1024))
    clock = itertools.count()
    router = Router(list(COSTS), "T", profile, model_free={"ngram"}, config=config,
                    timer=lambda: next(clock) * 1e-5)  # every reading 10 us later: the same at every run
    for pair, alpha in ALPHAS.items():
        router.similarity.observe_acceptance(pair, GREEDY, 100 * alpha, 100 * (1 - alpha))
    router.similarity.observe_hits("ngram", 40, 100)
    return router


def forwards_of(plans, L: int) -> list[ForwardRecord]:
    """Every model's forward of the step, padded to its widest row, timed by COSTS."""
    widths: dict[str, int] = {}
    rows: dict[str, int] = {}
    for chain, k in plans:
        for j, m in enumerate(chain):
            w = 1 if len(chain) == 1 or k == 0 else (k if j == 0 else k + j)
            widths[m], rows[m] = max(widths.get(m, 0), w), rows.get(m, 0) + 1
    return [ForwardRecord(m, rows[m], widths[m], L, COSTS[m](rows[m], widths[m], L)) for m in widths]


def play_step(router, rows, plans, rng, live: dict[int, list[int]]) -> None:
    """One scripted step after `plan_batch`: each row's cycle of the iid model (`iid_cycle`, rows
    in order), the step observed at its forwards' seconds, the rows advanced by what they
    committed (`live`: seq_id -> [context length, tokens left]), the finished ones finished."""
    outcomes = []
    for r, (chain, k) in zip(rows, plans):
        drafted, accepted = iid_cycle(rng, chain, k, ALPHAS, ngram_hit=0.4)
        outcomes.append(RowOutcome(r.seq_id, chain, k, drafted, accepted, True, r.context_len))
    L = sum(r.context_len for r in rows) // len(rows)
    fwd = forwards_of(plans, L)
    seconds = sum(f.seconds for f in fwd)
    router.observe_step(StepReport(outcomes, fwd, seconds + 4e-4, seconds, speculates(plans)))
    for o in outcomes:
        committed = int(o.accepted[-1]) + 1 if len(o.chain) > 1 and o.k > 0 else 1
        live[o.seq_id][0] += committed
        live[o.seq_id][1] -= committed
        if live[o.seq_id][1] <= 0:
            del live[o.seq_id]
            router.finish_request(o.seq_id)


def scripted_run(steps: int = 400, seed: int = 0, router: Router | None = None) -> list[tuple]:
    """Every step's plans (with their reasons and predicted T_eff), hold flags, shadow k and
    lease, as planned; concurrency moves 1 -> 8 -> 2 -> 4 over the run. `router`: the one to
    run (default `build_router()`)."""
    rng = random.Random(seed)
    router = build_router() if router is None else router
    live: dict[int, list[int]] = {}  # seq_id -> [context length, tokens left]
    ids = itertools.count()
    log = []
    for step in range(steps):
        want = (1, 8, 2, 4)[step * 4 // steps]
        while len(live) < want:
            live[next(ids)] = [100 + rng.randrange(400), 20 + rng.randrange(60)]
        rows = [RowContext(s, L, batch_size=len(live), remaining=left) for s, (L, left) in live.items()]
        batch = router.plan_batch(rows)
        plans = [(d.chain, d.k) for d in batch.decisions]
        log.append((tuple((d.chain, d.k, d.reason, d.t_eff) for d in batch.decisions),
                    batch.held, batch.shadow_k, batch.steps))
        play_step(router, rows, plans, rng, live)
    return log


def test_the_step_seconds_memo_changes_no_plan(monkeypatch):
    computed = {"n": 0}
    inner = BatchPlanner._step_seconds

    def counting(self, *a, **kw):
        computed["n"] += 1
        return inner(self, *a, **kw)

    monkeypatch.setattr(BatchPlanner, "_step_seconds", counting)
    monkeypatch.setattr(BatchPlanner, "STEP_MEMO", False)
    reference, uncached = scripted_run(), computed["n"]
    monkeypatch.setattr(BatchPlanner, "STEP_MEMO", True)
    computed["n"] = 0
    assert scripted_run() == reference
    assert computed["n"] < uncached  # the memo served some predictions
    kinds = {("spec" if any(k for _, k, _, _ in plans) else "held" if held else "plain")
             for plans, held, _, _ in reference}
    assert {"spec", "held"} <= kinds, kinds  # the run speculates and holds batches plain


@pytest.mark.parametrize("size", [1, 3])
def test_the_memo_is_bounded_and_kept_per_published_version(monkeypatch, size):
    """A full memo starts afresh (any size gives the same plans), and a republished evidence
    version never reads seconds computed under the old one."""
    monkeypatch.setattr(BatchPlanner, "STEP_MEMO", False)
    reference = scripted_run(steps=120)
    monkeypatch.setattr(BatchPlanner, "STEP_MEMO", True)
    monkeypatch.setattr(BatchPlanner, "STEP_MEMO_SIZE", size)
    assert scripted_run(steps=120) == reference
    router = build_router()
    plans = [(("d1", "T"), 3), (("T",), 0)]
    first = router.planner.step_seconds(plans, 300)
    assert router.planner._step_memo[0] == router.board.published.version
    router.overhead["spec"] += 0.01  # an overhead moved: a new key, not the old value
    assert router.planner.step_seconds(plans, 300) == pytest.approx(first + 0.01)
