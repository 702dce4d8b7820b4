"""benchmarks/router_replay.py: a run's router calls, recorded and replayed on a fresh router,
plan exactly what the run planned (the harness the router's host-time work checks its decisions
with: two versions of the router planned alike on a real trace when their digests are equal)."""

from __future__ import annotations

import hashlib
import itertools
import random
import sys
from pathlib import Path

from test_planner_memo import build_router, play_step

from specrouter.config import RouterConfig
from specrouter.records.routing import RowContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import router_replay  # noqa: E402


def digest_of(plans: list) -> str:
    d = hashlib.sha256()
    for decisions, batch in plans:
        d.update(repr([(x.chain, x.k, x.reason, round(x.t_eff, 12) if x.t_eff == x.t_eff else None,
                        round(x.min_confidence, 12)) for x in decisions]).encode())
        d.update(repr(batch).encode())
    return d.hexdigest()[:16]


def test_a_replayed_run_plans_what_the_run_planned():
    rng = random.Random(3)
    # a deterministic timer: its decide() seconds are the same in the replay; the 4-row margin
    # this run was built with (0.10; asked for each row beside the first since load25), so that
    # its 4-row batches are planned as well as held
    router = build_router(RouterConfig(batch_plain_margin=0.10 / 3))
    setup = router_replay.setup_of(router)
    recorder = router_replay.Recorder(router)
    live, ids, planned = {}, itertools.count(), []
    for step in range(240):
        while len(live) < (1, 4, 2)[step * 3 // 240]:
            live[next(ids)] = [100 + rng.randrange(300), 10 + rng.randrange(40)]
        rows = [RowContext(s, L, batch_size=len(live), remaining=left) for s, (L, left) in live.items()]
        batch = router.plan_batch(rows)
        planned.append((batch.decisions, (batch.held, batch.shadow_k, batch.steps)))
        plans = [(d.chain, d.k) for d in batch.decisions]
        play_step(router, rows, plans, rng, live)
    trace = {"setup": setup, "calls": recorder.calls}
    seconds, replayed = router_replay.replay(trace, deterministic=True)
    assert replayed == digest_of(planned)
    assert router_replay.replay(trace, deterministic=True)[1] == replayed
    kinds = {kind for name, kind in seconds if name == "plan_batch"}
    assert any(k.startswith("planned rows=4") for k in kinds) and any(k.startswith("held") for k in kinds), kinds
