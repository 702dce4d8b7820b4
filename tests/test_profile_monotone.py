"""A cost profile never prices a forward below a smaller one (router/profile.py `monotone`, with
`ProfileConfig.monotone`, off by default): the
sweep's first timed cell, right after the runner's first prefill, read the Sapphire Rapids
target's 1-token forward at 13.9 ms where its 2-token one read 9.6 (the engine's plain step ran
~8.5), and a router that speculates never runs the 1-token forward that would correct it, so
plain decoding stayed 45% too dear (docs/router.md, 2026-12-06)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_router import FakeRunner, VClock, cost_T

from specrouter.config import ProfileConfig
from specrouter.router.profile import CostProfile, ModelIdentity, fingerprint_key, machine_fingerprint, monotone, sweep

ON = ProfileConfig(monotone=True)


def test_monotone_is_the_largest_table_below_the_input_that_never_decreases():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.uniform(0.5, 2.0, size=(3, 5, 2))
        m = monotone(x)
        assert np.all(m <= x)
        for axis in range(3):
            assert np.all(np.diff(m, axis=axis) >= 0)
    good = np.cumsum(np.cumsum(np.ones((2, 4, 3)), axis=1), axis=2)
    assert np.array_equal(monotone(good), good)  # a sane sweep is kept as it is


class StallingRunner(FakeRunner):
    """The first `stall` forwards after its first prefill cost `factor` x (a cold start)."""

    def __init__(self, *args, stall=6, factor=1.6):
        super().__init__(*args)
        self.left, self.factor, self.first = stall, factor, []

    def forward(self, batch):
        t = max(batch.num_tokens_list)
        if t < 200 and self.left > 0:  # (not the prefill)
            self.left -= 1
            before = self.clock.t
            out = super().forward(batch)
            self.clock.t += (self.factor - 1.0) * (self.clock.t - before)
            self.first.append(self.clock.t - before)
            return out
        return super().forward(batch)


def test_a_sweep_whose_first_cell_stalled_prices_the_one_token_forward_as_it_runs():
    clock = VClock()
    runner = StallingRunner("T", cost_T, clock, 1000)
    prof = sweep({"T": runner}, repeats=3, warmup=1, progress=False, clock=clock, wider_tokens=(),
                 profile=CostProfile(ON))
    assert min(runner.first) == pytest.approx(1.6 * cost_T(1, 1, 128))  # what the first cell read
    for L in (128, 1024):
        assert prof.predict("T", 1, 1, L) == pytest.approx(cost_T(1, 1, L), rel=1e-9)
        assert prof.predict("T", 1, 1, L) <= prof.predict("T", 1, 2, L)
    # off (the default), the stalled reading stays: a 1-token forward above a 2-token one
    runner = StallingRunner("T", cost_T, clock, 1000)
    prof = sweep({"T": runner}, repeats=3, warmup=1, progress=False, clock=clock, wider_tokens=())
    assert prof.predict("T", 1, 1, 128) == pytest.approx(1.6 * cost_T(1, 1, 128))
    assert prof.predict("T", 1, 1, 128) > prof.predict("T", 1, 2, 128)


def test_a_saved_profile_with_a_slow_one_token_cell_loads_repaired(tmp_path):
    """This machine's file as it was (the target's (b 1, t 1, L 128) cell read 13.9 ms against
    9.6 ms at t 2 and 11.7 ms at L 1024): loaded, the cell reads as its cheapest neighbour above."""
    ident = ModelIdentity("T", 1000, "bfloat16")
    seconds = [[[0.01393, 0.01170], [0.00958, 0.01235], [0.01017, 0.01511]]]
    fp = machine_fingerprint()
    doc = {"format": 1, "machines": {fingerprint_key(fp): {"fingerprint": fp, "models": {ident.key(): {
        "identity": {"name": "T", "num_params": 1000, "dtype": "bfloat16", "device": "cpu"},
        "batch_sizes": [1], "new_tokens": [1, 2, 4], "context_lengths": [128, 1024], "seconds": seconds}}}}}
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(doc))
    assert CostProfile.load(path, [ident]).predict("T", 1, 1, 128) == pytest.approx(0.01393)  # off: as saved
    prof = CostProfile.load(path, [ident], config=ON)
    assert prof.predict("T", 1, 1, 128) == pytest.approx(0.00958)
    assert prof.predict("T", 1, 2, 128) == pytest.approx(0.00958)
    assert prof.predict("T", 1, 1, 1024) == pytest.approx(0.01170)
