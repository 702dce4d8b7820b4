"""bench/order.py: request i's run order is the list rotated by i, with target-only moved next
to SpecRouter (after it on even requests, before it on odd ones)."""

import pytest

from specrouter.bench.order import run_order

SYSTEMS = ["target-only", "s1", "s2", "s3", "s4", "s5", "SpecRouter", "sr-no-suffix"]
PAIR = ("SpecRouter", "target-only")


def test_without_a_pair_the_order_is_the_rotation():
    assert run_order(SYSTEMS, 0) == SYSTEMS
    assert run_order(SYSTEMS, 1) == SYSTEMS[1:] + SYSTEMS[:1]
    assert run_order(SYSTEMS, len(SYSTEMS) + 2) == run_order(SYSTEMS, 2)


@pytest.mark.parametrize("i", range(2 * len(SYSTEMS)))
def test_the_pair_runs_side_by_side_alternating_which_goes_first(i):
    order = run_order(SYSTEMS, i, PAIR)
    assert sorted(order) == sorted(SYSTEMS)
    a, b = order.index("SpecRouter"), order.index("target-only")
    assert b == (a + 1 if i % 2 == 0 else a - 1)
    # every other system keeps its place in the rotation
    rotated = [s for s in run_order(SYSTEMS, i) if s != "target-only"]
    assert [s for s in order if s != "target-only"] == rotated


def test_the_plain_rotation_keeps_the_pair_apart():
    """Negative control: without the pair, the two run 2 or more systems apart on most requests
    (the drift of those seconds lands on one and not the other)."""
    apart = [i for i in range(len(SYSTEMS))
             if abs(run_order(SYSTEMS, i).index("SpecRouter") - run_order(SYSTEMS, i).index("target-only")) > 1]
    assert len(apart) >= len(SYSTEMS) - 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="request index"):
        run_order(SYSTEMS, -1, PAIR)
    with pytest.raises(ValueError, match="two distinct systems"):
        run_order(SYSTEMS, 0, ("SpecRouter", "missing"))
    with pytest.raises(ValueError, match="two distinct systems"):
        run_order(SYSTEMS, 0, ("SpecRouter", "SpecRouter"))
