"""The request sets of the `structured` workload beside the bench's own (issue 30): REWORDED
(session 21), HELDOUT (session 23; read since for a rule choice), UNSEEN (session 24, run since) and
FRESH25 (session 25, run since) and FRESH26 (session 26, run since) must have the bench's
shape, so that benchmarks/structured.py --requests reworded|heldout|unseen|fresh25|fresh26|all runs
them like STRUCTURED: each kind with its schema, the kinds interleaved (the first of each kind first),
chat-length messages, and no request copied from another set nor a person or city of one (nor, for
UNSEEN, FRESH25 and FRESH26, a shopping item of one)."""

import re

import pytest

from specrouter.bench.structured import (FRESH25, FRESH26, HELDOUT, PERSON, REWORDED, SHOPPING,
                                         STRUCTURED, UNSEEN, WEATHER_CALL)

SCHEMA_OF = {"extract": PERSON, "tool": WEATHER_CALL, "list": SHOPPING}
# the people and cities each older set names
FIRST_NAMES = ("Lovelace", "Turing", "Curie", "Einstein", "Tesla", "London", "Paris", "Chicago", "Oslo",
               "Tokyo", "Buenos Aires", "Warsaw", "Ulm", "Smiljan")
HELDOUT_NAMES = ("Okafor", "Rita", "Lagos", "Cape Town", "Jonas", "Lindqvist", "Gothenburg", "Edinburgh",
                 "Frida", "Kahlo", "Rivera", "Coyoacán", "Mexico City", "Reykjavik")
UNSEEN_NAMES = ("Inês", "Carvalho", "Porto", "Kraków", "Marta", "Wanjiru", "Kamau", "Nairobi", "Zermatt",
                "Minh Chau", "Tran", "Da Nang", "Whitfield", "Marrakech", "Priya")
FRESH25_NAMES = ("Kwame", "Mensah", "Kumasi", "Hobart", "Katharina", "Vogel", "Leipzig", "Montevideo",
                 "Tomás", "Ibarra", "Valparaíso", "Queenstown", "Haruki", "Nakamura", "Kanazawa",
                 "Anchorage")
# the shopping items of the older sets (whole words)
OLDER_ITEMS = ("flour", "eggs", "milk", "butter", "maple syrup", "apples", "bananas", "bread", "lettuce",
               "tomatoes", "cucumber", "onion", "cheese", "water", "sugar", "lemons", "avocados", "limes",
               "chili", "cilantro", "salt", "chicken", "rice", "spinach", "coffee", "napkins", "juice",
               "crisps", "ice")
UNSEEN_ITEMS = ("lentils", "carrots", "tortillas", "salsa", "chickpeas", "toothpaste", "dish soap",
                "batteries", "dog food", "charcoal", "sausages", "burger buns", "corn", "ketchup")
FRESH25_ITEMS = ("paper towels", "olive oil", "greek yogurt", "dishwasher tablets", "pine board",
                 "wood screws", "wood glue", "L-brackets", "printer paper", "whiteboard markers",
                 "ring binders", "baguettes", "fromages", "cidre", "grapes")


def _word(text):
    """`text` as a whole word or phrase, any case."""
    return re.compile(rf"\b{re.escape(text)}\b", re.IGNORECASE)


@pytest.mark.parametrize("requests,per_kind", [(STRUCTURED, 3), (REWORDED, 2), (HELDOUT, 3), (UNSEEN, 3),
                                                 (FRESH25, 4), (FRESH26, 4)],
                         ids=["structured", "reworded", "heldout", "unseen", "fresh25", "fresh26"])
def test_request_set_shape(requests, per_kind):
    assert len(requests) == 3 * per_kind
    for i, (kind, schema, message) in enumerate(requests):
        assert kind == ("extract", "tool", "list")[i % 3], (i, kind)
        assert schema is SCHEMA_OF[kind], (i, kind)  # the bench's schemas, not copies
        assert isinstance(message, str) and 40 <= len(message) <= 400, (i, len(message))
        assert message == message.strip(), i


@pytest.mark.parametrize("new,older,names", [
    (HELDOUT, STRUCTURED + REWORDED, FIRST_NAMES),
    (UNSEEN, STRUCTURED + REWORDED + HELDOUT, FIRST_NAMES + HELDOUT_NAMES),
    (FRESH25, STRUCTURED + REWORDED + HELDOUT + UNSEEN, FIRST_NAMES + HELDOUT_NAMES + UNSEEN_NAMES),
    (FRESH26, STRUCTURED + REWORDED + HELDOUT + UNSEEN + FRESH25,
     FIRST_NAMES + HELDOUT_NAMES + UNSEEN_NAMES + FRESH25_NAMES)],
    ids=["heldout", "unseen", "fresh25", "fresh26"])
def test_held_out_requests_are_new(new, older, names):
    mine = [m for _, _, m in new]
    assert len(set(mine)) == len(mine)
    assert not {m for _, _, m in older} & set(mine)
    # different people and places: no request of the new set names a person or a city of the older
    # (whole words: "Friday" does not name Frida)
    for name in names:
        assert any(_word(name).search(m) for _, _, m in older), name  # the list is the older sets'
        assert not any(_word(name).search(m) for m in mine), name


@pytest.mark.parametrize("new,older,items", [
    (UNSEEN, STRUCTURED + REWORDED + HELDOUT, OLDER_ITEMS),
    (FRESH25, STRUCTURED + REWORDED + HELDOUT + UNSEEN, OLDER_ITEMS + UNSEEN_ITEMS),
    (FRESH26, STRUCTURED + REWORDED + HELDOUT + UNSEEN + FRESH25, OLDER_ITEMS + UNSEEN_ITEMS + FRESH25_ITEMS)],
    ids=["unseen", "fresh25", "fresh26"])
def test_held_out_shopping_items_are_new(new, older, items):
    older = " ".join(m for kind, _, m in older if kind == "list")
    mine = " ".join(m for kind, _, m in new if kind == "list")
    for item in items:
        assert _word(item).search(older), item  # the list is the older sets'
        assert not _word(item).search(mine), item
