"""KV invariant: after any random sequence of feeds, commits and rollbacks, every model's
cache equals a fresh prefill of the sequence's committed tokens."""

import random

import pytest
import torch

from specrouter.models.pool import load_runner
from specrouter.models.runners.base import ForwardBatch
from specrouter.state.manager import StateManager


def next_logits(runner, slot, start, feed):
    batch = ForwardBatch.build([slot], [start], [feed], [[len(feed) - 1]])
    return runner.forward(batch)[0, 0]


def assert_cache_is_fresh_prefill(runner, state, tokens, fresh_slot):
    """The cached prefix + pending tokens give the same next-token logits as a fresh prefill.
    (The check writes past cache_len only, which the contract allows.)"""
    assert state.cache_len < len(tokens)
    got = next_logits(runner, state.slot, state.cache_len, tokens[state.cache_len:])
    want = next_logits(runner, fresh_slot, 0, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_random_commits_and_rollbacks_keep_caches_exact(tiny_pool_dirs, backend):
    rng = random.Random(0)
    runners = {
        name: load_runner(tiny_pool_dirs[name], name=name, backend=backend, dtype=torch.float64,
                          num_slots=4)
        for name in ("draft", "target")
    }
    for r in runners.values():
        r.reserve(4, 160)
    sm = StateManager(runners)
    fresh = {n: r.allocate_slot() for n, r in runners.items()}  # scratch slot for fresh prefills
    seqs = {}
    for sid in range(3):
        sm.add(sid)
        seqs[sid] = [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))]
    for step in range(60):
        sid = rng.choice(list(seqs))
        tokens = seqs[sid]
        if len(tokens) > 120:
            continue
        op = rng.random()
        # a cycle: some models are fed their pending tokens plus speculative ones
        used = [n for n in runners if rng.random() < 0.7]
        spec = {n: [rng.randrange(3, 300) for _ in range(rng.randint(0, 5))] for n in used}
        for n in used:
            st = sm.state(sid, n)
            feed = tokens[st.cache_len:] + spec[n]
            batch = ForwardBatch.build([st.slot], [st.cache_len], [feed], [[len(feed) - 1]])
            runners[n].forward(batch)
            sm.fed(st, tokens, spec[n])
        # commit: a prefix of one model's speculative tokens, then a fresh token
        before = len(tokens)
        src = spec[used[0]] if used else []
        new = src[: rng.randint(0, len(src))] + [rng.randrange(3, 300)]
        tokens.extend(new)
        sm.commit(sid, tokens, before)
        if op < 0.25:  # an explicit rollback of a random model (e.g. a dropped model)
            n = rng.choice(list(runners))
            if n in sm.states_of(sid):
                sm.rollback(sm.state(sid, n), rng.randint(0, len(tokens) - 1))
        for n, st in sm.states_of(sid).items():
            assert_cache_is_fresh_prefill(runners[n], st, tokens, fresh[n])
    for sid in list(seqs):
        sm.release(sid)
    assert sm.live() == []
