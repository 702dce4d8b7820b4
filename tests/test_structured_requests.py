"""The request sets of the `structured` workload beside the bench's own (issue 30): REWORDED
(session 21) and HELDOUT (session 23, held out from tuning) must have the bench's shape, so that
benchmarks/structured.py --requests reworded|heldout|all runs them like STRUCTURED: each kind
with its schema, the kinds interleaved (the first of each kind first), chat-length messages, and
no request copied from another set nor a person or city of one."""

import pytest

from specrouter.bench.structured import HELDOUT, PERSON, REWORDED, SHOPPING, STRUCTURED, WEATHER_CALL

SCHEMA_OF = {"extract": PERSON, "tool": WEATHER_CALL, "list": SHOPPING}


@pytest.mark.parametrize("requests,per_kind", [(STRUCTURED, 3), (REWORDED, 2), (HELDOUT, 3)],
                         ids=["structured", "reworded", "heldout"])
def test_request_set_shape(requests, per_kind):
    assert len(requests) == 3 * per_kind
    for i, (kind, schema, message) in enumerate(requests):
        assert kind == ("extract", "tool", "list")[i % 3], (i, kind)
        assert schema is SCHEMA_OF[kind], (i, kind)  # the bench's schemas, not copies
        assert isinstance(message, str) and 40 <= len(message) <= 400, (i, len(message))
        assert message == message.strip(), i


def test_heldout_requests_are_new():
    others = {m for _, _, m in STRUCTURED + REWORDED}
    mine = [m for _, _, m in HELDOUT]
    assert len(set(mine)) == len(mine)
    assert not others & set(mine)
    # different people and places: no held-out request names a person or a city of the others'
    # (shopping items may repeat: milk is milk)
    for name in ("Lovelace", "Turing", "Curie", "Einstein", "Tesla", "London", "Paris", "Chicago",
                 "Oslo", "Tokyo", "Buenos Aires", "Warsaw", "Ulm", "Smiljan"):
        assert any(name in m for _, _, m in STRUCTURED + REWORDED), name  # the list is the others'
        assert not any(name.lower() in m.lower() for m in mine), name
