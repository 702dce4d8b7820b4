"""`specrouter demo` measures SpecRouter against target-only with no shared learning state: the
SpecRouter run never drafts from the baseline's answer (a recording drafter notices if it does),
and the first system alternates per prompt."""

import dataclasses

import numpy as np

from fixtures import named_router
from specrouter.api import SpecRouter
from specrouter.cli.demo import compare
from specrouter.drafters.suffix import SuffixDrafter


class RecordingSuffix(SuffixDrafter):
    """A suffix drafter that records every request it learns from, and every time it is asked to
    draft for a context that is a strict prefix of a request it has already learned: that is
    drafting from an answer it has seen (another system's, on a shared pool)."""

    def __init__(self, config=None):
        super().__init__(config)
        self.seen: list[list[int]] = []
        self.replays: list[list[int]] = []

    def fresh(self):
        return RecordingSuffix(self.config)

    def observe_request(self, tokens, tenant=None):
        self.seen.append([int(t) for t in tokens])
        super().observe_request(tokens, tenant)

    def propose_row(self, context, k, tenant=None, min_confidence=0.0):
        ctx = [int(t) for t in np.asarray(context)]
        if any(len(s) > len(ctx) and s[: len(ctx)] == ctx for s in self.seen):
            self.replays.append(ctx)
        return super().propose_row(context, k, tenant, min_confidence)


PROMPTS = [("code", "def add(a, b):\n", False), ("qa", "User: What is the capital", False),
           ("fox", "The quick brown fox", False)]


def _recording_router(tiny_pool_dirs, tmp_path):
    sr = named_router(tiny_pool_dirs, ["target", "draft"], profile_path=tmp_path / "profile.json")
    pool = dataclasses.replace(sr.pool, drafters={**sr.pool.drafters, "suffix": RecordingSuffix()})
    return SpecRouter(pool, sr.router, sr.config)


def test_demo_systems_never_see_each_others_output(tiny_pool_dirs, tmp_path):
    sr = _recording_router(tiny_pool_dirs, tmp_path)
    rows = list(compare(sr, PROMPTS, max_new_tokens=24))
    drafter = sr.pool.drafters["suffix"]
    assert len(drafter.seen) == 1 + len(PROMPTS)  # the warm-up and its own requests, nothing else
    assert drafter.replays == []
    assert [r.spec_first for r in rows] == [False, True, False]  # alternates
    assert all(r.identical for r in rows)


def test_a_shared_pool_is_caught_replaying_the_baseline(tiny_pool_dirs, tmp_path, monkeypatch):
    """Negative control: the demo as it was (baseline and SpecRouter on one pool) replays."""
    sr = _recording_router(tiny_pool_dirs, tmp_path)
    monkeypatch.setattr(type(sr.pool), "with_fresh_drafters", lambda self: self)
    list(compare(sr, PROMPTS, max_new_tokens=24))
    assert sr.pool.drafters["suffix"].replays


def test_the_baseline_can_run_on_another_path_and_identity_is_checked_on_sprouters(tiny_pool_dirs, tmp_path):
    """Where plain decoding is fastest on another kernel path, the timed baseline runs there and
    SpecRouter's greedy tokens are compared with target-only on its own path (a third run)."""
    from specrouter.models.runners.llama import load_llama_runner

    sr = named_router(tiny_pool_dirs, ["target", "draft"], profile_path=tmp_path / "profile.json")
    ref = sr.pool.runners["target"]
    other = load_llama_runner(ref.checkpoint_dir, name="target", dtype=ref.dtype, kernels="torch")
    rows = list(compare(sr, PROMPTS[:2], max_new_tokens=12, plain_runner=other))
    assert all(r.ref is not None and r.identical for r in rows)
    assert all(r.spec.token_ids == r.ref.token_ids for r in rows)
    broken = dataclasses.replace(rows[0], ref=dataclasses.replace(rows[0].ref, token_ids=[-1]))
    assert not broken.identical  # identity reads the reference, not the timed baseline
