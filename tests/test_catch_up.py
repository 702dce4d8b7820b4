"""Catch-up evidence (router/catch_up.py): a single stream decoding without its model draft
catches the draft up every `RouterConfig.catch_up_every` generated tokens, and the draft's
token at each position it caught up on, against the committed one, is an acceptance trial.

1. Through the real engine (tiny float64 pool): the executor's counts are exactly the
   teacher-forced agreement of the draft with the committed tokens, greedy and sampled (the
   draft's own coupled sample at each position), over exactly the positions it caught up on;
   the draft's cache is a fresh prefill after every step; the output is plain decoding's.
2. Through the router (test_router's scripted pool and virtual clock): a stream whose draft was
   refuted by its first cycles returns to it soon after the draft starts agreeing, where without
   catch-ups (and without the idle fade) it decodes plainly to its end; a draft that keeps
   disagreeing stays off."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import processors_reference as reference
from fixtures import load_named_pool
from test_router import L0, Sim, make_router, observe_cycle
from test_state import assert_cache_is_fresh_prefill

from specrouter.config import RouterConfig, SamplingParams
from specrouter.decoding.sampling import SamplingTensors, choose_at
from specrouter.engine.engine import Engine
from specrouter.models.runners.base import ForwardBatch
from specrouter.records.routing import BatchPlan, Decision, RowContext
from specrouter.router.catch_up import catch_up_models, stream_catch_ups

PAIR = ("d2", "T")


# -- 1. the executor's trials ------------------------------------------------------------------
class PlainCatchingUp:
    """A scripted router (RouterProtocol): every row decodes plainly; a lone row whose draft
    lags by `every` generated tokens catches it up (the router's own rule, `stream_catch_ups`).
    Keeps every step's report."""

    step_clock = None
    measure_tv = False
    tv_positions = 0

    def __init__(self, every: int, draft: str = "draft"):
        self.every, self.draft, self.reports = every, draft, []

    def plan_batch(self, rows, pinned=()):
        decisions = [Decision(("target",), 0, 0.01, "same") for _ in rows]
        return BatchPlan(decisions, catch_up=stream_catch_ups(rows, [d.chain for d in decisions], len(pinned),
                                                              self.every, {self.draft}))

    def take_confident_drafts(self, rows, plans, offers, pinned=()):
        return plans

    def observe_step(self, report):
        self.reports.append(report)

    def finish_request(self, seq_id):
        pass

    def mark_failed(self, model):
        pass


def teacher_forced(pool, tokens, seq_key, params, positions, prompt_len):
    """The draft's token at each of `positions` (sequence positions) given the tokens before
    it: one fresh prefill of the draft over `tokens`, logits everywhere, each position's
    processed by the reference processors (tests/processors_reference.py) with the tokens before
    it as its history, sampled as the executor samples (decoding/sampling.py `choose_at`: the
    row's seed key and the position)."""
    runner = pool.runners["draft"]
    slot = runner.allocate_slot()
    try:
        batch = ForwardBatch.build([slot], [0], [tokens], [[p - 1 for p in positions]])
        logits = runner.forward(batch).double()  # (1, G, V)
        if params.has_processors:
            logits = torch.stack([reference.process_row(logits[0, g : g + 1], reference.RowHistory(
                params, tokens[:p], prompt_len, frozenset(), [], 0))[0] for g, p in enumerate(positions)])[None]
        return choose_at(logits, SamplingTensors.from_params([params]), [0], [seq_key], positions)[0].tolist()
    finally:
        runner.free_slot(slot)


def run(pool, router, prompt, params):
    """Decode one request through an Engine running `router`; after every step each model's
    cache must be a fresh prefill of the committed tokens. Returns the sequence."""
    eng = Engine(pool, max_num_seqs=2, max_model_len=96, router=router, clock=lambda: 0.0)
    scratch = {n: r.allocate_slot() for n, r in pool.runners.items()}
    seq = eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
        if seq.done:
            break
        for name, st in eng.state.states_of(seq.seq_id).items():
            assert_cache_is_fresh_prefill(pool.runners[name], st, seq.tokens, scratch[name])
    return seq


PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3)


@pytest.mark.parametrize("temperature,controls", [(0.0, {}), (0.8, {}), (0.0, PENALTIES), (0.8, PENALTIES)],
                         ids=["greedy", "sampled", "greedy-penalties", "sampled-penalties"])
def test_caught_up_trials_are_the_drafts_teacher_forced_agreement(tiny_pool_dirs, temperature, controls):
    """Every 3 generated tokens the plain stream's draft catches up; the trials reported are,
    over exactly the positions caught up on (the first generated one to the last catch-up's
    cycle start), the positions where the draft's own token (argmax, or its coupled sample; with
    penalties, of its logits processed with the tokens before each position as their history)
    equals the committed one; the draft's first catch-up also prefilled the prompt; the output
    is plain decoding's."""
    pool = load_named_pool(tiny_pool_dirs, ("target", "draft"))
    prompt = [5, 17, 33, 8, 90, 41, 7, 5, 17, 33]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=3, **controls)
    router = PlainCatchingUp(every=3)
    seq = run(pool, router, prompt, params)
    plain = run(pool, None, prompt, params)
    assert seq.tokens == plain.tokens
    caught = [(r.outcomes[0].context_len, r.outcomes[0].caught_up) for r in router.reports if r.outcomes[0].caught_up]
    assert len(caught) >= 5, caught
    assert all(c == (("draft", c[0][1], c[0][2]),) for _, c in caught)
    last = caught[-1][0]  # the last catch-up's cycle start: the position its last token sampled
    positions = list(range(len(prompt), last + 1))
    assert sum(c[0][2] for _, c in caught) == len(positions)
    drafted = teacher_forced(pool, seq.tokens[:last], seq.seed_key, params, positions, len(prompt))
    want = sum(d == seq.tokens[p] for d, p in zip(drafted, positions))
    got = sum(c[0][1] for _, c in caught)
    print(f"\n{got} of {len(positions)} positions agree ({temperature=}, {controls=})")
    assert got == want
    assert 0 < got < len(positions)  # the test would see a wrong position's token (noise: a draft, not a copy)


@pytest.mark.parametrize("temperature", [0.0, 0.3], ids=["greedy", "sampled"])
def test_an_exact_copy_caught_up_under_penalties_agrees_everywhere(tiny_pool_dirs, temperature, monkeypatch):
    """A draft that is an exact copy of the target, caught up under strong penalties on a
    repeating prompt: every trial agrees (its logits processed with the same history as the
    target's were: greedy, and sampled through the shared noise). Negative control: the same
    run with the catch-up's processors skipped disagrees where the penalties moved the target."""
    pool = load_named_pool(tiny_pool_dirs, ("target", "same"))
    prompt = [5, 17, 33, 8] * 4
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=5,
                            presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.5)

    def trials():
        router = PlainCatchingUp(every=3, draft="same")
        run(pool, router, prompt, params)
        caught = [r.outcomes[0].caught_up[0] for r in router.reports if r.outcomes[0].caught_up]
        return sum(c[1] for c in caught), sum(c[2] for c in caught)

    matches, n = trials()
    assert n >= 24 and matches == n, (matches, n)
    import specrouter.decoding.catch_up as catch_up_module
    monkeypatch.setattr(catch_up_module, "process_rows", lambda logits, rows, inplace=False: logits.double())
    unprocessed, n2 = trials()
    print(f"\n{matches}/{n} agree processed, {unprocessed}/{n2} unprocessed ({temperature=})")
    assert n2 == n and unprocessed < n


def test_catch_up_rule():
    """`catch_up_models`: models the row's chain leaves out, lagging by `every` generated
    tokens or more (processors or not), never with `every` 0; `stream_catch_ups`: a single
    stream's only."""
    row = RowContext(0, 40, lags=(("d", 12), ("m", 3)), lags_generated=(("d", 8), ("m", 3)))
    assert catch_up_models(row, ("T",), 8, {"d", "m"}) == ("d",)
    assert catch_up_models(row, ("T",), 3, {"d", "m"}) == ("d", "m")
    assert catch_up_models(row, ("ngram", "T"), 3, {"d"}) == ("d",)
    assert catch_up_models(row, ("d", "T"), 3, {"d", "m"}) == ("m",)
    assert catch_up_models(row, ("T",), 0, {"d", "m"}) == ()
    assert catch_up_models(dataclasses.replace(row, processors=True), ("T",), 3, {"d"}) == ("d",)
    assert stream_catch_ups([row], [("T",)], 0, 8, {"d"}) == (("d",),)
    assert stream_catch_ups([row, row], [("T",), ("T",)], 0, 8, {"d"}) == ()
    assert stream_catch_ups([row], [("T",)], 1, 8, {"d"}) == ()


# -- 2. the router's use of them -------------------------------------------------------------
def stream(first, then, refuted=10, cycles=160, seed=0, **config):
    """One request of `cycles` engine steps (test_router_lock_in's stream): the draft agrees on
    `first` of the tokens for its first `refuted` steps, then on `then`; a plan's catch-up
    reports `lag` teacher-forced trials at the current agreement. Returns (one character per
    step: "S" speculated, "." plain; tokens per virtual second; catch-ups)."""
    router = make_router(order=["d2", "T"], timer=lambda: 0.0, config=RouterConfig(**config))
    sim = Sim({PAIR: then}, seed=seed)
    rng = random.Random(seed + 1000)
    steps, tokens, seconds, lag, left, catches = [], 0, 0.0, 1, 4 * cycles, 0
    for i in range(cycles):
        alpha = first if i < refuted else then
        sim.per_request[0] = {"alphas": {PAIR: alpha}}
        row = RowContext(0, L0 + tokens, remaining=left, lags=(("d2", lag),), lags_generated=(("d2", lag),))
        batch = router.plan_batch([row])
        d = batch.decisions[0]
        stats, outcomes, fwd, committed = sim.run(d.chain, d.k, [0], L0 + tokens)
        fwd = [g for f in fwd for g in [dataclasses.replace(f, seconds=f.seconds / f.count, count=1)] * f.count]
        if batch.catch_up and batch.catch_up[0]:
            matches = sum(rng.random() < alpha for _ in range(lag))
            outcomes = [dataclasses.replace(outcomes[0], caught_up=(("d2", matches, lag),))]
            catches += 1
            lag = 0
        observe_cycle(router, stats, outcomes, fwd)
        lag = 1 if len(d.chain) > 1 else lag + 1  # the draft misses every plainly decoded token
        tokens, left, seconds = tokens + committed[0], left - committed[0], seconds + stats.wall_time
        steps.append("S" if len(d.chain) > 1 else ".")
    return "".join(steps), tokens / seconds, catches


def test_a_refuted_draft_that_agrees_again_is_taken_back():
    """The draft agrees on 5% for 10 steps, then on 50% (or 35%): with catch-ups every stream
    speculates again from its first probe (50%: from step 20 on, 95% of its steps) or within 100
    steps (35%), and runs faster. Negative control, catch-ups off (the probes and the idle fade
    still on): most streams stay plain for 40 steps or more after the change (50%), or to their
    end (35%)."""
    gained = []
    for seed in range(4):
        steps, rate, catches = stream(0.05, 0.5, seed=seed)
        old, old_rate, _ = stream(0.05, 0.5, seed=seed, catch_up_every=0)
        print(f"\n{steps} {rate:.1f} tok/s\n{old} {old_rate:.1f} tok/s (no catch-ups)")
        assert steps[20:].count("S") >= 0.95 * len(steps[20:]), steps
        assert rate >= old_rate * 0.999 and catches >= 1
        gained.append(rate / old_rate)
        steps35, _, _ = stream(0.05, 0.35, seed=seed)
        old35, _, _ = stream(0.05, 0.35, seed=seed, catch_up_every=0)
        print(f"{steps35} (35%)\n{old35} (35%, no catch-ups)")
        assert steps35[100:].count("S") >= 0.9 * len(steps35[100:]), steps35
        gained.append(steps35[100:].count("S") - old35[100:].count("S"))
    assert sum(g > 1.02 for g in gained[0::2]) >= 2 and sum(g > 30 for g in gained[1::2]) >= 3, gained


def test_a_draft_that_keeps_disagreeing_stays_off():
    """Negative control: a draft at 5% throughout is caught up ~every 8 steps and never taken
    back (at most 5% of the steps after the fallback speculate, the probes' share); the stream
    runs no slower than without catch-ups (the simulator does not charge the catch-up forward:
    ~1% of the plain steps it covers on the AMX machine, router/catch_up.py)."""
    for seed in range(3):
        steps, rate, catches = stream(0.05, 0.05, seed=seed)
        _, old_rate, _ = stream(0.05, 0.05, seed=seed, catch_up_every=0)
        print(f"\n{steps} {rate:.2f} vs {old_rate:.2f} tok/s, {catches} catch-ups")
        assert steps[10:].count("S") <= 0.05 * len(steps[10:]), steps
        assert catches >= 12 and rate >= 0.99 * old_rate, (catches, rate, old_rate)
