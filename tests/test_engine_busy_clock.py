"""The router times the engine's own work: what a caller does between `Engine.step` calls (a
server handing a step's tokens to its event loop and waiting for it) is not a step's host
seconds (`Engine.busy_clock`, router/host_time.py), so the server's router and the library's
decide the same on the same requests (docs/serving-performance.md, eleventh round)."""

import torch
from test_engine_kv import NAMES, scripted_profile

from specrouter.config import SamplingParams
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.router.policy import Router


TICK = 2.0 ** -10  # ~1 ms, a binary fraction: every difference of readings is exact


class Ticks:
    """A deterministic clock: every reading advances it one TICK (time passes inside a step as
    its code reads the clock); `idle` advances it without a reading (a caller's own time)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += TICK
        return self.t

    def idle(self, ticks: int) -> None:
        self.t += ticks * TICK


def run(pool, gap: int, raw_clock: bool = False):
    """Three requests one after another on an engine with the adaptive router, the caller
    spending `gap` ticks after every step; the router's learned host seconds outside the
    executor, its decisions and the outputs. `raw_clock`: the router reads the engine's clock
    itself (what it did before the busy clock)."""
    clock = Ticks()
    router = Router.from_pool(pool, scripted_profile({}), timer=lambda: 0.0)
    eng = Engine(pool, max_num_seqs=1, max_model_len=96, router=router, clock=clock)
    if raw_clock:
        router.step_clock = clock
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = []
    for n in (5, 9, 7):
        seq = eng.add_request(torch.randint(3, 300, (n,), generator=g).tolist(), params)
        while not seq.done:
            eng.step()
            clock.idle(gap)
        outputs.append(seq.output_ids)
    outside = (router.overhead["outside_plain"], router.overhead["outside_spec"])
    return outside, [(e.chain, e.k) for e in router.events], outputs


def test_the_callers_time_between_steps_is_not_the_steps(tiny_pool_dirs):
    """A caller that spends 50 ms after every step (a server's hand-off) leaves the router's
    measured host seconds, its decisions and the outputs exactly as a caller that spends none.
    Negative control: a router reading the raw clock learns the gap (capped at a step's wall) and
    charges it."""
    # model drafts only: the suffix drafter times its own proposals with the real clock
    pool = Pool.load([tiny_pool_dirs[n] for n in NAMES], names=NAMES, target="target", dtype="float64",
                     ngram=False, suffix=False)
    quiet, busy = run(pool, 0), run(pool, 50)
    assert quiet[0] != (0.0, 0.0)  # something was measured
    assert busy == quiet
    raw_quiet, raw_busy = run(pool, 0, raw_clock=True), run(pool, 50, raw_clock=True)
    assert max(raw_busy[0]) > max(raw_quiet[0]) + TICK  # the gap, capped at a step's wall, in the EMA
