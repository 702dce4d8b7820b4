"""One forward per model per step (issue 14): rows on different chains, draft lengths and seeds
share every model's forward; outputs stay exactly the target's; seeded requests are
reproducible whatever the router does and equal plain decoding with the same seed; the router
plans the batch (plain decoding when the cost surface makes batching win)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from test_engine_sampling import PARAMS, PROMPT, V, target_joint  # noqa: F401
from test_engine_sampling import pool as v8_pool  # noqa: F401
from test_router_engine import RandomRouter

from specrouter.config import RouterConfig, SamplingParams
from specrouter.decoding import executor as executor_module
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.router import batch as batch_module
from specrouter.router.policy import Router, RowContext
from specrouter.records.routing import RowOutcome
from specrouter.router.profile import CostProfile


class CountingRunner:
    """Wraps a runner; counts forwards (every other attribute is the wrapped runner's)."""

    def __init__(self, inner, counts: Counter):
        self.__dict__["_inner"], self.__dict__["_counts"] = inner, counts

    def forward(self, batch):
        self._counts[self._inner.name] += 1
        return self._inner.forward(batch)

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def __setattr__(self, attr, value):
        setattr(self._inner, attr, value)


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    d = tiny_pool_dirs
    names = ["draft", "mid", "target"]
    return Pool.load([d[n] for n in names], names=names, target="target", dtype="float64")


def counting(pool) -> tuple[Pool, Counter]:
    counts: Counter = Counter()
    runners = {n: CountingRunner(r, counts) for n, r in pool.runners.items()}
    return Pool(runners=runners, drafters=pool.drafters, order=pool.order, target=pool.target,
                tokenizer=pool.tokenizer, eos_ids=pool.eos_ids, vocab_width=pool.vocab_width), counts


def alone(pool, prompt, n, params=None):
    params = params or SamplingParams(max_new_tokens=n, ignore_eos=True)
    return Engine(pool).generate_ids([prompt], [params], chain=("target",))[0].output_ids


def prompts_of(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_three_chains_one_forward_per_model(pool):
    """Rows on [ngram, target], [draft, target], [ngram, draft, mid, target] and plain: each model
    runs exactly once per step (k = 1); longer drafts add only one-token draft steps."""
    cpool, counts = counting(pool)
    proposals = Counter()
    ngram = cpool.drafters["ngram"]
    propose = ngram.propose
    ngram.propose = lambda *a, **kw: (proposals.update(["ngram"]), propose(*a, **kw))[1]
    try:
        eng = Engine(cpool)
        eng.reserve(4, 64)
        chains = [("ngram", "target"), ("draft", "target"), ("ngram", "draft", "mid", "target"), ("target",)]
        p = SamplingParams(max_new_tokens=8, ignore_eos=True)
        seqs = [eng.add_request(pr, p, chain=c, k=1) for pr, c in zip(prompts_of(4), chains)]
        eng.step()
        assert dict(counts) == {"draft": 1, "mid": 1, "target": 1} and proposals["ngram"] == 1
        while eng.has_unfinished():
            eng.step()
        for s, pr in zip(seqs, prompts_of(4)):
            assert s.output_ids == alone(pool, pr, 8)
        counts.clear()
        eng2 = Engine(cpool)
        eng2.reserve(3, 64)
        for pr, c, k in zip(prompts_of(3), [("draft", "target"), ("draft", "mid", "target"), ("mid", "target")], (4, 2, 3)):
            eng2.add_request(pr, p, chain=c, k=k)
        eng2.step()
        # draft: one shared forward + 3 more steps (k = 4); mid verifies one row and drafts
        # another in ONE forward, + 2 more steps (k = 3); the target once
        assert dict(counts) == {"draft": 4, "mid": 3, "target": 1}
        while eng2.has_unfinished():
            eng2.step()
    finally:
        ngram.propose = propose


def test_greedy_exact_with_mixed_chains_and_ks_in_one_batch(pool):
    chains = [("draft", "target"), ("ngram", "mid", "target"), ("target",), ("draft", "mid", "target"),
              ("ngram", "target"), ("mid", "target"), ("ngram", "draft", "mid", "target")]
    prompts = prompts_of(len(chains), seed=5)
    eng = Engine(pool)
    eng.reserve(len(chains), 64)
    seqs = [eng.add_request(pr, SamplingParams(max_new_tokens=10 + i, ignore_eos=True), chain=c, k=1 + i % 5)
            for i, (pr, c) in enumerate(zip(prompts, chains))]
    while eng.has_unfinished():
        eng.step()
    for i, (s, pr) in enumerate(zip(seqs, prompts)):
        assert s.output_ids == alone(pool, pr, 10 + i), chains[i]


def test_seeded_request_reproducible_whatever_the_router_does(pool):
    """A seeded sampling request: the same output alone, among other requests, with chains and
    k switching at random every cycle, and pinned to plain decoding of the target."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, seed=1234, ignore_eos=True)
    prompt = prompts_of(1, seed=9)[0]
    plain = Engine(pool).generate_ids([prompt], [params], chain=("target",))[0].output_ids
    others = prompts_of(5, seed=10)
    outputs = []
    for router_seed, crowd in ((0, 0), (1, 2), (2, 5)):
        eng = Engine(pool, router=RandomRouter(pool, seed=router_seed))
        eng.reserve(6, 64)
        rows = [eng.add_request(pr, SamplingParams(temperature=0.7, max_new_tokens=12, ignore_eos=True))
                for pr in others[:crowd]]
        seq = eng.add_request(prompt, params)
        rows.append(seq)
        while eng.has_unfinished():
            eng.step()
        outputs.append(seq.output_ids)
        assert sum(seq.stats.chains.values()) >= 2
    assert all(o == plain for o in outputs), (plain, outputs)
    other_seed = Engine(pool).generate_ids([prompt], [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16,
                                                                    seed=99, ignore_eos=True)], chain=("target",))
    assert other_seed[0].output_ids != plain


def joint_of(seqs) -> torch.Tensor:
    out = torch.tensor([s.output_ids for s in seqs])  # (rows, 2)
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((out[:, 0], out[:, 1]), torch.ones(len(seqs), dtype=torch.float64), accumulate=True)
    return counts / len(seqs)


def mixed_batch(v8_pool, rows: int) -> list:
    """`rows` rows of the same prompt, each with its own seed, on three chains in one batch."""
    eng = Engine(v8_pool)
    eng.reserve(rows, 16)
    chains = [(("draft", "target"), 3), (("draft", "mid", "target"), 2), (("target",), 0), (("mid", "target"), 1)]
    seqs = []
    for i in range(rows):
        chain, k = chains[i % len(chains)]
        p = SamplingParams(temperature=PARAMS.temperature, top_p=PARAMS.top_p, max_new_tokens=2,
                           ignore_eos=True, seed=10_000 + i)
        seqs.append(eng.add_request(PROMPT, p, chain=chain, k=max(k, 1)))
    while eng.has_unfinished():
        eng.step()
    return seqs


def test_per_row_seeds_in_one_batch_keep_the_distribution(v8_pool):
    exact = target_joint(v8_pool)
    seqs = mixed_batch(v8_pool, 40_000)
    tv = 0.5 * (joint_of(seqs) - exact).abs().sum().item()
    assert tv < 0.025, tv  # 64 outcomes, 40k draws: noise alone ~0.015
    assert sum(s.stats.cycles for s in seqs) < 2 * len(seqs)  # drafts were used


def test_negative_control_noise_without_position(v8_pool, monkeypatch):
    """Noise keyed by the seed only (the same at every position): tokens are no longer
    independent across positions, and the same test must fail."""
    monkeypatch.setattr(executor_module, "token_positions", lambda work, G, *a: [0] * (len(work) * G))
    exact = target_joint(v8_pool)
    seqs = mixed_batch(v8_pool, 40_000)
    tv = 0.5 * (joint_of(seqs) - exact).abs().sum().item()
    assert tv > 0.05, tv


# ----------------------------------------------------------------------------- batch planning


def scripted_router(target_cost, draft_cost=lambda b, t, L: 0.0005) -> Router:
    prof = CostProfile()
    grid = dict(batch_sizes=(1, 4, 8), new_tokens=(1, 2, 4, 8, 16), context_lengths=(128, 1024))
    prof.set_function("target", target_cost, **grid)
    prof.set_function("draft", draft_cost, **grid)
    router = Router(["draft", "target"], "target", prof, config=RouterConfig(probe_fraction=0.0),
                    timer=lambda: 0.0)  # decide() time off the clock: the test is about costs
    for _ in range(50):  # the pair accepts 80%
        router.similarity.observe_acceptance(("draft", "target"), "greedy", 4, 1)
    return router


def rows_of(n):
    return [RowContext(seq_id=i, context_len=200, batch_size=n, greedy=True, remaining=64) for i in range(n)]


def test_router_plans_plain_when_batching_wins():
    """Flat in rows, steep in tokens per row from 2 rows on (a compute-bound target): one row
    speculates, eight rows decode plainly."""
    def target(b, t, L):
        return 0.040 if b == 1 else 0.040 + 0.020 * (t - 1) * b / 4

    router = scripted_router(target)
    single = router.plan_batch(rows_of(1)).decisions
    assert single[0].k > 0 and single[0].chain == ("draft", "target")
    eight = router.plan_batch(rows_of(8)).decisions
    assert all(d.chain == ("target",) and d.k == 0 for d in eight), eight


def test_router_speculates_when_forwards_stay_flat():
    """A forward that costs the same for every rows x tokens up to the grid (memory bound):
    speculation is free, every row speculates."""
    router = scripted_router(lambda b, t, L: 0.040)
    eight = router.plan_batch(rows_of(8)).decisions
    assert all(d.chain == ("draft", "target") and d.k > 1 for d in eight), eight
    plain_step = router.planner.step_seconds([(("target",), 0)] * 8, 200)
    spec_step = router.planner.step_seconds([(d.chain, d.k) for d in eight], 200)
    assert spec_step > plain_step  # drafting costs something; the tokens pay for it


def test_sampled_rows_speculate_only_in_small_batches():
    """Where every greedy row speculates (flat forwards), sampled rows of a batch larger than
    `sampling_spec_max_batch` decode plainly (their acceptance is a similarity estimate); in a
    batch within it they speculate like greedy rows."""
    router = scripted_router(lambda b, t, L: 0.040)
    limit = router.config.sampling_spec_max_batch
    mixed = [dataclasses.replace(r, greedy=r.seq_id % 2 == 0) for r in rows_of(8)]
    out = router.plan_batch(mixed).decisions
    assert all((d.k > 0) == r.greedy for r, d in zip(mixed, out)), out
    small = [dataclasses.replace(r, greedy=False) for r in rows_of(limit)]
    assert all(d.chain == ("draft", "target") and d.k > 0 for d in router.plan_batch(small).decisions)


def test_plain_hold_skips_replanning_until_rows_change():
    """Where plain batching wins, the verdict holds for 2, 4, ... steps without re-planning (no
    per-row decide), through rows joining (more rows only favour plain batching), not through a
    row leaving; a hold of 0 re-plans every step."""
    def target(b, t, L):
        return 0.040 if b == 1 else 0.040 + 0.020 * (t - 1) * b / 4

    router = scripted_router(target)
    decides = Counter()
    inner = router.decide
    router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
    router.plan_batch(rows_of(8)).decisions  # planned: plain wins, hold 2 steps
    assert sum(decides.values()) == 8 and router.planner.hold.span == 2
    held = router.plan_batch(rows_of(8)).decisions
    assert sum(decides.values()) == 8 and router.planner.held_decisions == 8  # no decide: held
    assert all(d.chain == ("target",) and d.k == 0 for d in held)
    router.observed_steps += 2  # two steps later the hold is over: plan again, hold twice as long
    router.plan_batch(rows_of(8)).decisions
    assert sum(decides.values()) == 16 and router.planner.hold.span == 4
    router.plan_batch(rows_of(9)).decisions  # a row joined: still held
    assert sum(decides.values()) == 16 and router.planner.held_decisions == 17
    router.plan_batch(rows_of(6)).decisions  # two rows left: 6 >= 3/4 of 8, still held
    assert sum(decides.values()) == 16 and router.planner.held_decisions == 23
    router.plan_batch(rows_of(5)).decisions  # below 3/4 of the rows it was found for: planned afresh
    assert sum(decides.values()) == 21
    from specrouter.router.batch import hold_floor

    assert [hold_floor(n) for n in (2, 3, 4, 8, 16)] == [2, 3, 3, 6, 12]  # small batches: any departure
    no_hold = scripted_router(target)
    no_hold.config = dataclasses.replace(no_hold.config, plain_hold_max=0)
    no_hold.plan_batch(rows_of(8)).decisions
    no_hold.plan_batch(rows_of(8)).decisions
    assert no_hold.planner.held_decisions == 0 and no_hold.planner.hold is None


def test_a_plain_holds_longest_span_grows_with_the_rows(monkeypatch):
    """`BatchPlanner.hold_limit`: a batch held plain re-plans at spans 2, 4, ... up to
    plain_hold_max steps for each row beside the first (the plain margin grows so): over 160
    steps 3 rows reach 32-step spans, 4 rows 48, 8 rows 112 (8 and 7 re-plans at 4 and 8 rows).
    Negative control: the spans of load22 (plain_hold_max below JOINS_KEEP_HOLD rows, twice that
    from there): 4 rows stay at 16-step spans and re-plan 13 times."""
    def target(b, t, L):  # plain batching wins from 3 rows on: every candidate token costs a row's step
        return 0.040 if b == 1 else 0.040 + 0.010 * (t - 1) * b

    def spans(n, steps=160):
        router = scripted_router(target)
        decides = Counter()
        inner = router.decide
        router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
        seen = []
        while router.observed_steps < steps:
            plan = router.plan_batch(rows_of(n))
            assert all(d.k == 0 for d in plan.decisions) and plan.held
            hold = router.planner.hold
            seen.append(hold.span)
            router.observed_steps = hold.until  # the hold's steps run (leased), then it ends
        return seen, sum(decides.values()) // n

    cap = RouterConfig().plain_hold_max
    for n in (3, 4, 8):
        seen, plans = spans(n)
        assert max(seen) == cap * (n - 1) and plans == len(seen), (n, seen)
    assert len(spans(4)[0]) == 8 and len(spans(8)[0]) == 7
    assert max(spans(16, steps=240)[0]) == cap * 7  # capped at the 8-row span (a joiner waits for a hold's end)

    def load22(self, n, sampled):
        spec = self.calibrations.get((n, True, sampled))
        limit = self.router.config.plain_hold_max
        return limit * (self.STANDING_HOLD if spec is not None and spec.failed else 2 if n >= 8 else 1)

    monkeypatch.setattr(batch_module.BatchPlanner, "hold_limit", load22)
    seen, plans = spans(4)
    assert max(seen) == cap and plans == 13, seen


def plain_rows_router(plain_ids):
    """A scripted router whose verification is cheap enough that an 80%-accepting row speculates,
    with requests `plain_ids` whose own drafts were rejected 40 times (they decode plainly), and a
    Counter of decide() calls per seq_id."""
    def target(b, t, L):
        return 0.040 + 0.004 * (t - 1) * b

    router = scripted_router(target)
    for seq_id in plain_ids:
        req = router.request(seq_id, True)
        for _ in range(40):
            req.observe(("draft", "target"), 0, 1, router.config.request_decay)
    decides = Counter()
    inner = router.decide
    router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
    return router, decides


def test_plain_hold_of_a_small_batch_weighs_a_joining_row_alone():
    """Below JOINS_KEEP_HOLD rows, a request replacing a finished one (the batch size unchanged:
    a server under steady load) is decided on its own: one that would decode plainly joins the
    hold (one decide, the other rows undecided); one that would speculate ends it (the batch is
    planned afresh, the joiner decided once). From JOINS_KEEP_HOLD rows on a joining row keeps
    the hold undecided."""
    from specrouter.router.batch import JOINS_KEEP_HOLD

    router, decides = plain_rows_router((0, 1, 5))
    two = rows_of(2)
    assert all(d.k == 0 for d in router.plan_batch(two).decisions) and router.planner.hold is not None
    router.plan_batch(two)  # the same rows: held
    assert sum(decides.values()) == 2 and router.planner.held_decisions == 2
    plain_joiner = [two[0], dataclasses.replace(two[1], seq_id=5)]  # row 1 finished, request 5 joined
    plan = router.plan_batch(plain_joiner)
    assert plan.held and all(d.k == 0 for d in plan.decisions)
    assert decides[5] == 1 and sum(decides.values()) == 3  # the joiner alone was decided
    assert router.planner.hold.members == {0, 1, 5}
    router.plan_batch(plain_joiner)  # held, nobody decided
    assert sum(decides.values()) == 3
    spec_joiner = [two[0], dataclasses.replace(two[1], seq_id=7)]  # request 7 (prior: 80%) joined
    plan = router.plan_batch(spec_joiner)
    assert not plan.held and router.planner.hold is None and plan.decisions[1].k > 0
    assert decides[7] == 1 and decides[0] == 2  # planned afresh, the joiner decided once
    big = rows_of(JOINS_KEEP_HOLD)
    router.plan_batch(big)
    planned = sum(decides.values())
    assert router.planner.hold is not None
    router.plan_batch(big[1:] + [dataclasses.replace(big[0], seq_id=99)])  # a join at JOINS_KEEP_HOLD rows: held
    assert sum(decides.values()) == planned


def test_from_four_rows_a_joining_row_waits_for_the_holds_end(monkeypatch):
    """At 4 rows (JOINS_KEEP_HOLD: plain batching must be beaten by 30% there) a request replacing
    a finished one keeps the hold without a decide, even one that would speculate on its own; it
    is planned with the batch when the hold ends. At 3 rows the joiner is decided at once.
    Negative control: joins weighed below 8 rows (main before load26): the 4-row joiner is
    decided at the join."""
    def join(n):
        router, decides = plain_rows_router(range(n))
        rows = rows_of(n)
        assert all(d.k == 0 for d in router.plan_batch(rows).decisions) and router.planner.hold is not None
        joined = rows[:-1] + [dataclasses.replace(rows[-1], seq_id=7)]  # request 7 (prior: 80%)
        plan = router.plan_batch(joined)
        return router, joined, plan, decides

    router, joined, plan, decides = join(4)
    assert plan.held and all(d.k == 0 for d in plan.decisions) and decides[7] == 0
    router.observed_steps = router.planner.hold.until  # the hold's steps ran: planned with the batch
    router.plan_batch(joined)
    assert decides[7] == 1
    assert join(3)[3][7] == 1  # below 4 rows the joiner is weighed at once
    monkeypatch.setattr(batch_module, "JOINS_KEEP_HOLD", 8)
    assert join(4)[3][7] == 1  # the negative control


def test_a_joiner_whose_speculation_lost_at_this_batch_size_joins_the_hold():
    """A request that would speculate on its own joins a held 2-row batch: where the batch
    calibration says 2-row speculative steps realised half their predicted rate, it joins the
    hold (one decide: the joiner's; plain plans, held), as `plan_afresh` would have found;
    without that evidence (the negative control) the hold ends and the batch is planned afresh
    (the other row decided again, the joiner speculates)."""
    from specrouter.router.batch import StepCalibration

    def target(b, t, L):  # verification cheap enough that an 80%-accepting row speculates
        return 0.040 + 0.004 * (t - 1) * b

    def run(lost: bool):
        router = scripted_router(target)
        for seq_id in (0, 1):  # the held rows' own drafts are mostly rejected: they decode plainly
            req = router.request(seq_id, True)
            for _ in range(40):
                req.observe(("draft", "target"), 0, 1, router.config.request_decay)
        if lost:
            cal = router.planner.calibrations[(2, True, False)] = StepCalibration()
            for _ in range(10):
                cal.add(2.0, 1.0, router.config.batch_calibration_discount)  # twice the predicted seconds
        decides = Counter()
        inner = router.decide
        router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
        two = rows_of(2)
        assert all(d.k == 0 for d in router.plan_batch(two).decisions) and router.planner.hold is not None
        plan = router.plan_batch([two[0], dataclasses.replace(two[1], seq_id=7)])  # request 7 (prior 80%)
        return plan, decides

    plan, decides = run(lost=True)
    assert plan.held and all(d.k == 0 for d in plan.decisions)
    assert decides == Counter({0: 1, 1: 1, 7: 1})  # the joiner alone decided at the join
    plan, decides = run(lost=False)  # the negative control: no evidence against speculation
    assert not plan.held and plan.decisions[1].k > 0 and decides == Counter({0: 2, 1: 1, 7: 1})


def test_a_drafts_catch_up_is_priced_and_kept_out_of_the_calibration():
    """Speculation that is free per step (flat target forwards) is planned for a 2-row batch
    whose draft is caught up; where the draft has not seen 400 tokens of each row (plain steps
    before, `RowContext.lags`), its catch-up forward (charged over `CATCH_UP_SPAN` steps) makes the
    batch plain. A speculative step in which the draft caught up does not calibrate the planner
    (its forward was wider than the plans need); the same step without it does. Negative
    controls: the same rows without lags speculate, and so do they with the catch-up charged over
    the speculative hold's 4 steps (`spec_hold_steps`, as before load26)."""
    from specrouter.records.routing import ForwardRecord

    def draft(b, t, L):  # a draft's forward costs its tokens: a catch-up of 400 costs 0.2 s
        return 0.0005 * t * b

    rows = rows_of(2)
    behind = [dataclasses.replace(r, lags=(("draft", 400),)) for r in rows]
    assert all(d.k > 0 for d in scripted_router(lambda b, t, L: 0.040, draft).plan_batch(rows).decisions)
    assert all(d.k == 0 for d in scripted_router(lambda b, t, L: 0.040, draft).plan_batch(behind).decisions)
    over_the_hold = scripted_router(lambda b, t, L: 0.040, draft)
    over_the_hold.planner.CATCH_UP_SPAN = over_the_hold.config.spec_hold_steps
    assert over_the_hold.config.spec_hold_steps == 4
    assert all(d.k > 0 for d in over_the_hold.plan_batch(behind).decisions)
    router = scripted_router(lambda b, t, L: 0.040, draft)
    plan = [(("draft", "target"), 4)] * 2
    for r in rows:
        router.request(r.seq_id, True)
    router.planner.planned = frozenset(r.seq_id for r in rows)
    outcomes = [RowOutcome(r.seq_id, c, k, [k, k], [0, 2], True, 200) for r, (c, k) in zip(rows, plan)]
    caught_up = [ForwardRecord("draft", 2, 400, 200, 0.2), ForwardRecord("target", 2, 5, 200, 0.04)]
    router.planner.observe(outcomes, caught_up, 0.25)
    assert not router.planner.calibrations
    router.planner.observe(outcomes, [ForwardRecord("draft", 2, 1, 200, 0.001)], 0.05)
    assert (2, True, False) in router.planner.calibrations


def test_a_batch_that_cannot_speculate_is_planned_without_per_row_work():
    """Sampled rows beyond `sampling_spec_max_batch` decode plainly (their acceptance is a
    similarity estimate): such a batch gets plain plans at once, held (no confident drafts), no
    shadow proposals and no per-row decide, even where greedy rows would speculate; one greedy
    row among them is planned as before. The plain plans stand `plain_hold_max` steps for the same
    rows (a lease, `BatchPlan.steps`: the engine runs them without planning); the mixed batch's
    speculating plans stand one step."""
    router = scripted_router(lambda b, t, L: 0.040)  # flat: greedy rows speculate
    decides = Counter()
    inner = router.decide
    router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
    sampled = [dataclasses.replace(r, greedy=False) for r in rows_of(router.config.sampling_spec_max_batch + 1)]
    plan = router.plan_batch(sampled)
    assert all(d.chain == ("target",) and d.k == 0 for d in plan.decisions)
    assert plan.held and plan.shadow_k == 0 and not decides
    assert plan.steps == router.config.plain_hold_max
    mixed = [dataclasses.replace(sampled[0], greedy=True)] + sampled[1:]
    plan = router.plan_batch(mixed)
    assert plan.decisions[0].k > 0 and all(d.k == 0 for d in plan.decisions[1:]) and len(decides) == len(mixed)
    assert plan.steps == 1


def test_single_row_is_never_held_while_it_speculates():
    router = scripted_router(lambda b, t, L: 0.040 if b == 1 else 0.1 * b * t)
    for _ in range(3):
        assert router.plan_batch(rows_of(1)).decisions[0].k > 0
    assert router.planner.held_decisions == 0


def test_a_settled_plain_single_stream_is_held_until_another_request_runs():
    """A single stream whose plain plan is settled (decided "same") is held plain without
    deciding (2, 4, ... steps) on a lease, its shadow proposals on the hold's last step; its first
    plain decision ("initial") holds nothing; another request, alone or joining, is planned at
    once."""
    router = scripted_router(lambda b, t, L: 0.040 * t)  # verifying costs t forwards: plain wins
    decides = Counter()
    decide = router.decide
    router.decide = lambda row: decides.update([row.seq_id]) or decide(row)
    one = rows_of(1)
    first = router.plan_batch(one)
    assert first.decisions[0].chain == ("target",) and first.decisions[0].reason == "initial"
    assert router.planner.hold is None  # not settled yet
    second = router.plan_batch(one)
    assert second.decisions[0].reason == "same" and second.held and router.planner.hold.span == 2
    held = router.plan_batch(one)
    assert held.held and decides[0] == 2 and router.planner.held_decisions == 1
    assert held.shadow_k == 0 or router.observed_steps == router.planner.hold.until - 1
    other = [dataclasses.replace(one[0], seq_id=7)]  # another request alone: planned at once
    assert not router.plan_batch(other).held and decides[7] == 1
    router.plan_batch(other)  # settled: held
    two = [other[0], dataclasses.replace(one[0], seq_id=8, batch_size=2)]
    router.plan_batch(two)  # a request joins: planned at once
    assert decides[8] == 1
    router.observed_steps += 2  # single stream again, after the hold
    router.plan_batch(one)
    assert decides[0] == 3


def test_no_speculation_planned_beyond_the_swept_batch_sizes():
    """Flat costs make every row speculate at 8 rows (the largest swept); at 9 rows the cost
    would be extrapolated: the batch decodes plainly."""
    router = scripted_router(lambda b, t, L: 0.040)
    assert all(d.k > 0 for d in router.plan_batch(rows_of(8)).decisions)
    nine = router.plan_batch(rows_of(9)).decisions
    assert all(d.chain == ("target",) and d.k == 0 for d in nine)


def run_calibrated(router, slow, steps, n=2, greedy=True, first=0, plain_slow=1.0, accepts=None):
    """`steps` planned steps of n rows (seq_ids from `first`) whose speculative steps take `slow`
    times their predicted seconds and commit their predicted tokens (plain steps `plain_slow`
    times theirs; `accepts(step, k, predicted accepted)`: the drafts each row accepts instead);
    whether each speculated."""
    chosen = []
    for step in range(steps):
        rows = [dataclasses.replace(r, seq_id=first + r.seq_id, greedy=greedy) for r in rows_of(n)]
        plans = [(d.chain, d.k) for d in router.plan_batch(rows).decisions]
        outcomes = []
        for r, (c, k) in zip(rows, plans):
            accepted = max(0, round(router.planner.expected_tokens(router.requests.get(r.seq_id), c, k)) - 1)
            if accepts is not None and k > 0:
                accepted = accepts(step, k, accepted)
            outcomes.append(RowOutcome(r.seq_id, c, k, [k] * len(c), [0] + [accepted] * (len(c) - 1),
                                       greedy, r.context_len))
        spec = any(k > 0 for _, k in plans)
        router.planner.observe(outcomes, [], router.planner.step_seconds(plans, 200) * (slow if spec else plain_slow))
        router.observed_steps += 1  # the engine's step clock (observe_step's tick)
        chosen.append(spec)
    return chosen


def calibration_target(b, t, L):  # speculation at 2 rows is predicted to win, by less than 2x
    return 0.040 + 0.004 * (t - 1) * b


def test_batch_calibration_turns_a_slower_than_predicted_batch_plain():
    """A 2-row batch whose speculative steps take twice what the cost profile predicts (the
    tokens they commit are the predicted ones) turns plain within 20 steps; the same steps at
    their predicted speed keep speculating; a single row is not affected. The failed try's
    correction stands while plain steps run (`StepCalibration.forget`); a plan predicted to
    gain more than that error (the target's forwards flat in tokens) speculates again. A 4-row
    batch's correction that did not fail (within the plain margin) ages as before."""
    run, target = run_calibrated, calibration_target
    honest = scripted_router(target)
    assert all(run(honest, 1.0, 20))
    slow = scripted_router(target)
    assert not all(run(slow, 2.0, 20))
    spec_factor = slow.planner.calibrations[(2, True, False)].factor(slow.config.batch_calibration_prior)
    assert 0.45 < spec_factor < 0.65  # realised half the predicted rate, shrunk toward 1
    assert run(slow, 2.0, 1, n=1) == [True]
    assert not any(run(slow, 1.0, 200))  # the error stands
    slow.profile.set_function("target", lambda b, t, L: 0.040, batch_sizes=(1, 4, 8), new_tokens=(1, 2, 4, 8, 16),
                              context_lengths=(128, 1024))
    assert any(run(slow, 1.0, 65))  # predicted ~3x plain: clears the 0.5 error (once the plain hold ends)
    mild = scripted_router(target)
    # 5% slower than predicted: within the plain margin (the try may end at its first re-plan,
    # its predicted gain at 4 rows ~1.3x, near `plain_margin(4)`: its verdict is read there)
    assert run(mild, 1.05, 4, n=4)[:2] == [True, True]
    assert not mild.planner.calibrations[(4, True, False)].failed


def test_a_run_of_rejections_is_no_error_of_the_batchs_steps(monkeypatch):
    """2-row speculative steps at their predicted seconds whose rows accept drafts in runs (8
    steps of every draft rejected, then 8 of twice the predicted accepted drafts, and so on: about
    the predicted tokens over the run) keep speculating in all 64 steps: the batch calibration
    reads a step's seconds, its tokens are the requests' own evidence (`StepCalibration`).
    Negative control: the committed tokens read into the factor as on main 74c9d2d (each step's
    seconds scaled by its predicted / committed tokens): the first run of rejections ends the
    try, it is found failed, and the batch decodes plainly from then on."""
    def bursts(step, k, predicted):
        return 0 if (step // 8) % 2 == 0 else min(k, 2 * predicted)

    assert all(run_calibrated(scripted_router(calibration_target), 1.0, 64, accepts=bursts))
    observe = batch_module.BatchPlanner.observe

    def tokens_read(self, rows, forwards, wall_time):  # main's factor: realised / predicted tokens too
        plans = [(tuple(r.chain), r.k) for r in rows]
        if batch_module.speculates(plans):
            predicted = sum(self.expected_tokens(self.router.requests.get(r.seq_id), c, k) for r, (c, k) in zip(rows, plans))
            committed = sum(int(r.accepted[len(c) - 1]) + 1 if k > 0 else 1 for r, (c, k) in zip(rows, plans))
            wall_time *= predicted / committed
        observe(self, rows, forwards, wall_time)

    monkeypatch.setattr(batch_module.BatchPlanner, "observe", tokens_read)
    router = scripted_router(calibration_target)
    chosen = run_calibrated(router, 1.0, 64, accepts=bursts)
    assert not any(chosen[16:]) and router.planner.calibrations[(2, True, False)].failed


def test_a_try_is_judged_against_plain_steps_as_slow_as_its_own():
    """A machine slower than its profile: every 2-row step, speculative or plain, takes 1.2x its
    predicted seconds. A try of speculation that ends (rows that decode plainly run next) is not
    failed: its factor over plain batching's is ~1, so the plain holds stay capped at
    plain_hold_max and new rows that gain speculate at once. Read alone, as on main 74c9d2d
    (0.85 x (1 + batch_plain_margin) < 1), it was found failed. Control: the same try whose steps
    alone ran 1.2x slow (plain steps as predicted) is failed, and the holds grow to
    STANDING_HOLD x plain_hold_max."""
    def run(plain_slow):
        router = scripted_router(calibration_target)
        for seq_id in (10, 11):  # these rows' drafts are mostly rejected: they decode plainly
            req = router.request(seq_id, True)
            for _ in range(40):
                req.observe(("draft", "target"), 0, 1, router.config.request_decay)
        assert not any(run_calibrated(router, 1.2, 10, first=10, plain_slow=plain_slow))
        assert all(run_calibrated(router, 1.2, 20, plain_slow=plain_slow))
        assert not any(run_calibrated(router, 1.2, 4, first=10, plain_slow=plain_slow))  # the try ends
        return router

    router = run(plain_slow=1.2)
    assert not router.planner.calibrations[(2, True, False)].failed
    assert router.planner.hold_limit(2, False) == router.config.plain_hold_max
    assert all(run_calibrated(router, 1.2, 4, first=20, plain_slow=1.2))  # new rows speculate
    control = run(plain_slow=1.0)
    assert control.planner.calibrations[(2, True, False)].failed
    assert control.planner.hold_limit(2, False) == batch_module.BatchPlanner.STANDING_HOLD * control.config.plain_hold_max


def test_a_failed_try_of_speculation_is_not_retried_while_its_error_stands(monkeypatch):
    """A 2-row batch whose speculative steps realise half their predicted rate: the try that
    confirms the loss (`StepCalibration.failed`) keeps its correction while plain steps run, so
    over 700 steps it speculates only in its first try (at most two speculative holds).
    Speculation that realises its prediction is not held back (700 of 700). Negative control:
    a failed try's evidence forgotten like any other (the `failed` flag never set) retries
    every 30-130 steps (at least 8 tries)."""
    def tries(chosen):
        return [i for i, spec in enumerate(chosen) if spec and (i == 0 or not chosen[i - 1])]

    slow = run_calibrated(scripted_router(calibration_target), 2.0, 700)
    assert sum(slow) <= 2 * RouterConfig().spec_hold_steps and tries(slow) == [0], tries(slow)  # two holds
    assert all(run_calibrated(scripted_router(calibration_target), 1.0, 700))
    monkeypatch.setattr(batch_module.StepCalibration, "failed", property(lambda self: False, lambda self, v: None))
    assert len(tries(run_calibrated(scripted_router(calibration_target), 2.0, 700))) >= 8


def test_a_failed_trys_error_is_read_against_plain_steps_of_the_same_minutes(monkeypatch):
    """After a failed try (2-row speculation at half its predicted rate, plain steps as
    predicted), the machine slows: plain steps take 1.4x their predicted seconds, and the plain
    factor falls to ~0.7. The failed try's error stands relative to plain batching
    (`StepCalibration.relative`), so the batch stays plain for 600 steps. Negative control: the
    standing absolute factor (~0.5) read against the slower plain factor, which makes
    speculation look ~1.4x better than it did, tries again."""
    def run(relative: bool):
        router = scripted_router(calibration_target)
        first = run_calibrated(router, 2.0, 60)
        assert any(first[:6]) and not any(first[10:])
        if not relative:
            real = batch_module.BatchPlanner.calibration

            def absolute(self, n, sampled=False):
                spec = self.calibrations.get((n, True, sampled))
                if spec is not None:
                    spec.relative = None
                return real(self, n, sampled)
            monkeypatch.setattr(batch_module.BatchPlanner, "calibration", absolute)
        return run_calibrated(router, 2.0, 600, plain_slow=1.4)

    assert not any(run(relative=True))
    assert any(run(relative=False))


def test_a_hold_lasts_longer_while_speculations_error_stands(monkeypatch):
    """After a failed try of speculation at 2 rows (steps at half the predicted rate), the
    batch's plain holds grow to STANDING_HOLD x plain_hold_max steps (64): over 400 steps its
    rows are decided 13 times (the try, then hold ends after spans 2, 4, ..., 64, 64, ...), where
    holds capped at plain_hold_max (the negative control: STANDING_HOLD = 1) decide them 29 times. A
    batch whose speculation never failed is capped as before, and a row joining the long hold
    is still weighed at once (it speculates where plain batching does not lose)."""
    def decides(standing):
        monkeypatch.setattr(batch_module.BatchPlanner, "STANDING_HOLD", standing)
        router = scripted_router(calibration_target)
        count = Counter()
        inner = router.decide
        router.decide = lambda row: count.update([row.seq_id]) or inner(row)
        chosen = run_calibrated(router, 2.0, 400)
        return sum(count.values()), chosen, router

    long, chosen, router = decides(4)
    assert not any(chosen[10:]) and router.planner.hold.span == 64
    short, chosen_short, _ = decides(1)
    assert not any(chosen_short[10:])
    assert long <= 2 * 14 and short >= 2 * 26, (long, short)
    # a joiner is decided at once inside the long hold
    joined = dataclasses.replace(rows_of(2)[1], seq_id=99)
    count = Counter()
    inner = router.decide
    router.decide = lambda row: count.update([row.seq_id]) or inner(row)
    router.plan_batch([rows_of(2)[0], joined])
    assert count == Counter({99: 1})


def test_sampled_batches_are_calibrated_apart_from_greedy_ones(monkeypatch):
    """Sampled 2-row batches whose speculative steps take twice their predicted seconds turn
    plain; greedy 2-row batches on the same router, whose steps realise their predictions, keep
    speculating, before and after (a server runs both; the serving bench greedy first, then
    t=0.7). Negative control: one calibration for both modes (every batch keyed as greedy)
    carries the sampled batches' factor into the greedy ones, which then decode plainly."""
    def run():
        router = scripted_router(calibration_target)
        # 2-row sampled batches may speculate, read at their estimates (no decision margin: the negative
        # control needs the sampled batches' slow steps to reach the shared calibration)
        router.config = dataclasses.replace(router.config, sampling_spec_max_batch=2, decision_margin_sampling=0.0)
        for _ in range(50):
            router.similarity.observe_acceptance(("draft", "target"), "sampling", 4, 1)
        greedy_before = run_calibrated(router, 1.0, 10)
        sampled = run_calibrated(router, 2.0, 20, greedy=False, first=10)
        return greedy_before, sampled, run_calibrated(router, 1.0, 3, first=20)  # new requests

    greedy_before, sampled, greedy_after = run()
    assert all(greedy_before) and not all(sampled[-10:]) and all(greedy_after)
    monkeypatch.setattr(batch_module, "sampled", lambda rows: False)  # the negative control
    _, _, greedy_after = run()
    assert not any(greedy_after)


def test_steps_of_rows_the_planner_did_not_plan_do_not_calibrate_it():
    """Pinned speculating rows (a client's chain: the serving bench runs its static chains
    through the router's server) are not the planner's plans: steps running them, however long
    they take, do not calibrate it; the same steps of rows it planned move the factor (1.5x the
    predicted seconds: ~0.7), and so do the pinned ones when every row counts as planned (the
    negative control, run by hand)."""
    def target(b, t, L):
        return 0.040 + 0.004 * (t - 1) * b

    def observe(router, planned):
        rows = rows_of(2)
        router.plan_batch(rows if planned else [], [] if planned else [(("draft", "target"), 4)] * 2)
        outcomes = [RowOutcome(r.seq_id, ("draft", "target"), 4, [4, 4], [0, 4], True, r.context_len) for r in rows]
        router.planner.observe(outcomes, [], 1.5 * router.planner.step_seconds([(("draft", "target"), 4)] * 2, 200))
        router.observed_steps += 1

    pinned, planned = scripted_router(target), scripted_router(target)
    for _ in range(10):
        observe(pinned, planned=False)
        observe(planned, planned=True)
    prior = pinned.config.batch_calibration_prior
    assert not pinned.planner.calibrations and pinned.planner.calibration(2) == (1.0, 1.0)
    assert 0.65 < planned.planner.calibrations[(2, True, False)].factor(prior) < 0.75


def test_a_held_step_costs_no_per_row_planning():
    """Host work of a held batch, counted (not timed): over 64 steps of 4 rows where plain
    batching wins, the router decides rows only when a hold ends (spans 2, 4, 8, 16, 16, ...),
    predicts a plain step's seconds at most once per PLAIN_PREDICTION_STEPS steps, and asks
    for shadow proposals once per hold (its last step). Negative control: without the hold
    (plain_hold_max=0, predictions not reused) every row is decided, shadowed and the step
    predicted at every step."""
    def target(b, t, L):
        return 0.040 if b == 1 else 0.040 + 0.2 * (t - 1) * b / 4

    def run(router, steps=64, n=4):
        counts = Counter()
        decide, step_seconds = router.decide, router.planner.step_seconds
        router.decide = lambda row: counts.update(["decide"]) or decide(row)
        router.planner.step_seconds = lambda *a, **kw: counts.update(["predict"]) or step_seconds(*a, **kw)
        for i in range(steps):
            rows = [dataclasses.replace(r, context_len=200 + i) for r in rows_of(n)]
            plan = router.plan_batch(rows)
            assert all(d.k == 0 for d in plan.decisions)
            counts["shadow"] += plan.shadow_k > 0
            outcomes = [RowOutcome(r.seq_id, ("target",), 0, [0], [0], True, r.context_len) for r in rows]
            router.planner.observe(outcomes, [], 0.040)
            router.observed_steps += 1  # the engine's step clock (observe_step's tick)
        return counts

    held = run(scripted_router(target))
    # planned at steps 0, 2, 6, 14, 30, 62 (spans up to 48 at 4 rows); shadows on each hold's
    # last step (1, 5, 13, 29, 61)
    assert held["decide"] == 4 * 6 and held["shadow"] == 5, held
    assert held["predict"] <= 64 // 16 + 1, held
    off = scripted_router(target)
    off.config = dataclasses.replace(off.config, plain_hold_max=0)
    off.planner.PLAIN_PREDICTION_STEPS = 1  # and a plain step's seconds predicted afresh
    unheld = run(off)
    assert unheld["decide"] == 4 * 64 and unheld["shadow"] == 64 and unheld["predict"] >= 64


def test_speculation_must_beat_plain_batching_by_more_as_the_batch_grows(monkeypatch):
    """`BatchPlanner.plain_margin`: a speculative plan beats plain batching by
    `batch_plain_margin` for each row beside the first. Where every row's own plan speculates
    and the step's predicted gain over plain batching is ~1.2x at 4 rows (tokens per row
    cost 0.005 s a row), 2 and 3 rows speculate and 4 rows decode plainly. Negative control:
    the margin flat at `batch_plain_margin` (as before load25): 4 rows speculate too."""
    def target(b, t, L):
        return 0.040 + 0.005 * (t - 1) * b

    def ks(n):
        return [d.k for d in scripted_router(target).plan_batch(rows_of(n)).decisions]

    planner = scripted_router(target).planner
    assert planner.plain_margin(1) == pytest.approx(1.0 + planner.router.config.persist_margin)
    assert planner.plain_margin(2) == pytest.approx(1.10) and planner.plain_margin(4) == pytest.approx(1.30)
    assert all(k > 0 for k in ks(2)) and all(k > 0 for k in ks(3))
    assert ks(4) == [0, 0, 0, 0]
    monkeypatch.setattr(batch_module.BatchPlanner, "plain_margin",
                        lambda self, n: 1.0 + max(self.router.config.persist_margin,
                                                  self.router.config.batch_plain_margin if n > 1 else 0.0))
    assert all(k > 0 for k in ks(4))


def free_drafting_router(target_cost) -> Router:
    """`scripted_router`'s pair with a model-free drafter (a suffix store) below the target."""
    prof = CostProfile()
    grid = dict(batch_sizes=(1, 4, 8), new_tokens=(1, 2, 4, 8, 16), context_lengths=(128, 1024))
    prof.set_function("target", target_cost, **grid)
    prof.set_function("draft", lambda b, t, L: 0.0005, **grid)
    prof.set_function("suffix", lambda b, t, L: 0.0001, **grid)
    return Router(["suffix", "draft", "target"], "target", prof, model_free={"suffix"},
                  config=RouterConfig(probe_fraction=0.0), timer=lambda: 0.0)


def test_a_confident_draft_leaves_a_plain_multi_row_step_only_past_the_plain_margin(monkeypatch):
    """`take_confident_drafts` at a step of 4 plain rows: row 0's suffix drafter offers 4
    tokens. Scored 2.7 tokens (the step predicted ~1.2x plain batching's rate) it is not
    taken; scored 3.9 (~1.4x) it is; a single row takes the 2.7 draft (no batch margin); a step
    already speculating takes it where it raises the rate. Negative control: no margin for
    leaving plain (as before load25): the 2.7 draft is taken at 4 rows."""
    def target(b, t, L):
        return 0.040 + 0.001 * (t - 1) * b

    plain = (("target",), 0)

    def take(score, n=4, plans=None):
        router = free_drafting_router(target)
        plans = plans or [plain] * n
        return router.planner.take_confident_drafts(rows_of(n), list(plans), {0: ("suffix", 4, score)})

    assert take(2.7) == [plain] * 4
    assert take(3.9)[0] == (("suffix", "target"), 4)
    assert take(2.7, n=1)[0] == (("suffix", "target"), 4)
    spec = [plain, (("draft", "target"), 4), plain, plain]
    assert take(2.7, plans=spec)[0] == (("suffix", "target"), 4)
    monkeypatch.setattr(batch_module.BatchPlanner, "plain_margin", lambda self, n: 1.0)
    assert take(2.7)[0] == (("suffix", "target"), 4)


def test_a_speculating_batch_keeps_its_plans_for_spec_hold_steps():
    """A multi-row batch that speculates keeps its plans for the same rows
    `spec_hold_steps` steps (no decide; shadow proposals on the hold's last step only), a
    row joining or leaving re-plans at once, a single stream is not held by it (its own
    hold is router/stream_hold.py's); negative control: spec_hold_steps=1 decides every row every step."""
    def run(router, batches):
        decides, shadows, held = Counter(), [], []
        inner = router.decide
        router.decide = lambda row: (decides.update([row.seq_id]), inner(row))[1]
        for rows in batches:
            plan = router.plan_batch(rows)
            assert all(d.k > 0 for d in plan.decisions)
            shadows.append(plan.shadow_k > 0)
            held.append(plan.held)
            router.observed_steps += 1
        return decides, shadows, held

    flat = lambda b, t, L: 0.040  # noqa: E731 - every row speculates
    two = rows_of(2)
    three = rows_of(3)
    span = RouterConfig().spec_hold_steps
    assert span == 4
    decides, shadows, held = run(scripted_router(flat), [two] * (2 * span) + [three, three])
    assert held == ([False] + [True] * (span - 1)) * 2 + [False, True]
    assert shadows == ([False] * (span - 1) + [True]) * 2 + [False, False]
    assert decides == Counter({0: 3, 1: 3, 2: 1})  # the join (step 2 * span) planned afresh
    router = scripted_router(flat)
    router.config = dataclasses.replace(router.config, spec_hold_steps=1)
    decides, shadows, held = run(router, [two] * 4)
    assert decides == Counter({0: 4, 1: 4}) and not any(held) and all(shadows)
    router = scripted_router(flat)  # the batch's hold never holds a single stream (its own
    router.config = dataclasses.replace(router.config, stream_hold_steps=1)  # does: test_stream_hold.py)
    decides, _, held = run(router, [rows_of(1)] * 3)
    assert decides == Counter({0: 3}) and not any(held)


def test_engine_names_each_steps_kind(pool):
    """`Engine.last_step_kind` (the serving metrics' steps by kind): "spec" when a row drafts,
    "held" when the router's plan was its hold, "plain" otherwise (planned plain, no router).
    Negative control: the same plain plans not held read "plain"."""
    from fixtures import QuietRouterHooks

    from specrouter.records.routing import BatchPlan, Decision

    class Scripted(QuietRouterHooks):
        def __init__(self, script):
            self.script = iter(script)

        def plan_batch(self, rows, pinned=()):
            chain, k, held = next(self.script)
            return BatchPlan([Decision(chain, k, 0.0, "scripted") for _ in rows], held)

    plain, spec = (("target",), 0), (("draft", "target"), 3)
    script = [(*plain, False), (*plain, True), (*spec, True), (*spec, False), (*plain, True)]
    eng = Engine(pool, router=Scripted(script), max_num_seqs=2, max_model_len=96)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for p in prompts_of(2):
        eng.add_request(p, params)
    kinds = []
    for _ in script:
        eng.step()
        kinds.append(eng.last_step_kind)
    assert kinds == ["plain", "held", "spec", "spec", "held"]
    bare = Engine(pool, max_num_seqs=1, max_model_len=96)
    bare.add_request(prompts_of(1)[0], params, chain=("target",))
    bare.step()
    assert bare.last_step_kind == "plain"


def test_a_held_batch_runs_on_a_lease_and_reports_every_step(pool, monkeypatch):
    """Where plain batching wins, the engine runs a held batch's steps on the planner's lease
    (`BatchPlan.steps`: the same rows, until the step before the hold ends) without planning
    them: no row contexts, no plan_batch; every step is still reported to the router, in order,
    before it plans again or a request finishes, so it learns what it learns without the lease
    (the same observed steps, held decisions and hold), and greedy outputs are the target's.
    Negative control: leases off (every lease 1 step) plans every step."""
    def target(b, t, L):
        return 0.040 if b == 1 else 0.040 + 0.2 * (t - 1) * b / 4

    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = prompts_of(4)

    def run():
        router = scripted_router(target)
        eng = Engine(pool, router=router, max_num_seqs=4, max_model_len=128)
        counts, seen = Counter(), []
        plan, observe, finish = router.plan_batch, router.observe_step, router.finish_request

        def planned(rows, pinned=()):
            assert not eng._unreported  # the router has seen every step before it plans
            counts["plan"] += 1
            return plan(rows, pinned)

        def observed(report):
            seen.append([o.context_len for o in report.outcomes])
            observe(report)

        def finished(seq_id):
            assert not eng._unreported
            finish(seq_id)

        router.plan_batch, router.observe_step, router.finish_request = planned, observed, finished
        seqs = [eng.add_request(p, params) for p in prompts]
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        return router, counts, seen, steps, [s.output_ids for s in seqs]

    leased = run()
    monkeypatch.setattr(batch_module.BatchPlanner, "_lease",
                        lambda self, now, steps: setattr(self, "leased", None) or 1)
    unleased = run()
    for router, counts, seen, steps, outputs in (leased, unleased):
        assert outputs == [alone(pool, p, 40) for p in prompts]
        assert len(seen) == steps and router.observed_steps == steps  # every step reported
        assert seen == sorted(seen) and len({tuple(x) for x in seen}) == steps  # in order, once each
    assert leased[0].planner.held_decisions == unleased[0].planner.held_decisions > 0
    assert leased[0].planner.hold.span == unleased[0].planner.hold.span == 32  # 2, 4, ..., 32 in 40 steps
    assert unleased[1]["plan"] == unleased[3]
    assert leased[1]["plan"] <= unleased[3] // 3, (leased[1], leased[3])


def test_a_single_streams_draft_catch_up_is_weighed_over_the_cycles_it_has_left():
    """decide() prices a lagging draft's first forward at one token. Alone, a row whose draft
    must first catch up on many tokens (RowContext.lags) speculates only where that catch-up,
    spread over the cycles the row has left, still leaves speculation faster than plain
    decoding: near its end it decodes plainly (and is held, as a settled plain stream); with
    its request ahead of it, or with its draft in step, it speculates as before. Negative
    control: the row's own decision unweighed speculates near its end."""
    def target(b, t, L):
        return 0.040 if b == 1 else 0.040 + 0.020 * (t - 1) * b / 4

    def draft(b, t, L):
        return 0.002 * t

    def plan(remaining, lag, router=None):
        router = router or scripted_router(target, draft)
        row = RowContext(seq_id=0, context_len=200, batch_size=1, greedy=True, remaining=remaining,
                         lags=(("draft", lag),) if lag else ())
        return router.plan_batch([row]).decisions[0], router

    tail, router = plan(3, 100)
    assert tail.chain == ("target",) and tail.k == 0 and tail.reason == "catch-up"
    assert router.planner.hold is not None  # settled: held like a plain "same" verdict
    ahead, _ = plan(64, 100)
    assert ahead.chain == ("draft", "target") and ahead.k > 0
    in_step, _ = plan(3, 0)
    assert in_step.chain == ("draft", "target") and in_step.k > 0
    bare = scripted_router(target, draft)
    bare.planner.alone = lambda row, decision: decision
    assert plan(3, 100, bare)[0].k > 0


def test_the_catch_up_of_a_lone_rows_plain_steps_is_priced_over_the_request():
    """The catch-up trap: a lone row whose draft lags on tokens the row decoded plainly
    (`RowContext.lags_generated`) weighs that catch-up over every cycle its request has left,
    once; the same lag on its prompt keeps the `plain_hold_max` cap (a long prompt's catch-up
    weighed over the request speculated and lost, 20976a7). A walk over a 120-token request
    decoding plainly, its draft's lag growing a token a step, the row's own decision the draft
    throughout: priced per request it may speculate again until its lag is 58 tokens; capped
    (the generated tokens counted as prompt: the negative control, main's pricing) from 26 on it
    stays plain to its end. Near its end both decode plainly."""
    def target(b, t, L):
        return 0.040

    def draft(b, t, L):  # a dear catch-up: 8 ms a token (a Zen 1's draft forward is ~1/12 of its target's)
        return 0.003 + 0.008 * t

    def plan(lag, remaining, generated):
        router = scripted_router(target, draft)
        for _ in range(50):  # the pair accepts ~40%: k=1, a small gain with the draft in step
            router.similarity.observe_acceptance(("draft", "target"), "greedy", 1, 2)
        row = RowContext(seq_id=0, context_len=200, batch_size=1, greedy=True, remaining=remaining,
                         lags=(("draft", lag),), lags_generated=(("draft", lag if generated else 0),))
        return router.plan_batch([row]).decisions[0]

    walk = range(0, 112, 8)  # plain steps so far: lag 2 + s, 120 - s tokens left
    priced = [plan(2 + s, 120 - s, True) for s in walk]
    capped = [plan(2 + s, 120 - s, False) for s in walk]
    assert all(d.chain == ("draft", "target") and d.k > 0 for d in priced[:8]), priced[:8]  # lag 2..58
    assert all(d.k > 0 for d in capped[:3]) and all(d.reason == "catch-up" for d in capped[3:]), capped
    assert all(d.k == 0 and d.reason == "catch-up" for d in priced[9:]), priced[9:]  # near its end


def test_row_contexts_tell_a_drafts_lag_on_generated_tokens_from_its_prompt(pool):
    """`RowContext.lags` counts every token a model below the target has not seen;
    `lags_generated` those of them the row generated: none on a new request (its prompt), every
    plain step's token once the draft ran, and only the generated ones of a row that started
    plain (its prompt is lag too). Negative control: a row in step reports neither."""
    from fixtures import QuietRouterHooks

    from specrouter.records.routing import BatchPlan, Decision

    class Scripted(QuietRouterHooks):
        def __init__(self, script):
            self.script, self.rows = iter(script), []

        def plan_batch(self, rows, pinned=()):
            chain, k = next(self.script)
            self.rows.append(rows[0])
            return BatchPlan([Decision(chain, k, 0.0, "scripted") for _ in rows])

    plain, spec = (("target",), 0), (("draft", "target"), 1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = prompts_of(1)[0]
    for script in ([spec, plain, plain, plain, spec], [plain, plain, plain, spec]):
        router = Scripted(script)
        eng = Engine(pool, router=router, max_num_seqs=1, max_model_len=96)
        eng.add_request(prompt, params)
        for _ in script:
            eng.step()
        for row in router.rows:
            lags, made = dict(row.lags), dict(row.lags_generated)
            assert set(lags) == set(made) <= {"draft", "mid"}, row
            if script[0] == spec:
                if row is router.rows[0]:
                    assert lags["draft"] == len(prompt) and made["draft"] == 0
                elif row is router.rows[1]:  # the draft ran (1 or 2 tokens committed): in step
                    assert "draft" not in lags, row
                else:  # its plain steps' tokens
                    assert made["draft"] == lags["draft"] > 1, row
            else:
                assert lags["draft"] == row.context_len and made["draft"] == row.context_len - len(prompt), row
