"""A field draft's guess of a value's first word on records written as labels and lists
(decoding/field_drafts.py, step 3; issue 30, the reworded records of bench/structured.py):
a label's words (`Year of birth:`, `Location =`) are never a value's first word, nor a lower-case
word with digits in a string value (`x2`; `A320` is one), nor the role line ChatML puts at a message's start (`user`).
Each case fails with the rule taken out (the negative controls)."""

import pytest
from fixtures import four_level_fixtures
from test_field_drafts import PERSON

from specrouter.decoding import field_drafts
from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.grammar import GrammarSpec, RowGrammar
from specrouter.engine.constrained import _text_codec

SHOPPING = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
    "required": ["item", "quantity"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
CARD = "Profile card | Name: Nikola Tesla | Year of birth: 1856 | Hometown: Smiljan | Job: inventor."
LIST = "user\nOur trip needs: bread x2, cheese x3"
LIST_SO_FAR = '{"items": [{"item": "bread", "quantity": 2}, {"item": "'

pool, prompts = four_level_fixtures()


def guess(pool, schema, message, written):
    encode, decode, special = _text_codec(pool.tokenizer)
    grammar = RowGrammar(GrammarSpec.json_schema(schema), pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width,
                         frozenset(pool.eos_ids))
    fields = FieldDrafter(encode, decode, encode(message), special)
    return decode(fields.propose(grammar, encode(written), [], 16))


CASES = [  # (schema, message, written, guess, the guess without the rule)
    (PERSON, CARD, '{"name": "Nikola Tesla", "born": 1856, "city": "', 'Smiljan",', 'Year'),
    (SHOPPING, LIST, LIST_SO_FAR, 'cheese",', 'x2'),
    (SHOPPING, LIST, LIST_SO_FAR + 'cheese", "quantity": 3}, {"item": "', "", "user"),
]


@pytest.mark.parametrize("schema, message, written, expected, _", CASES)
def test_labels_codes_and_roles_are_no_value(pool, schema, message, written, expected, _):
    assert guess(pool, schema, message, written) == expected


def test_negative_controls_without_the_rules_the_guesses_are_wrong(pool, monkeypatch):
    labels = FieldDrafter._labels
    monkeypatch.setattr(FieldDrafter, "_labels", lambda self: frozenset())
    assert guess(pool, *CASES[0][:3]).startswith(CASES[0][4])
    monkeypatch.setattr(FieldDrafter, "_labels", labels)
    monkeypatch.setattr(field_drafts, "CODE", lambda w: False)
    assert guess(pool, *CASES[1][:3]).startswith(CASES[1][4])
    monkeypatch.undo()
    monkeypatch.setattr(field_drafts, "ROLE", field_drafts.re.compile(r"(?!)"))  # never matches
    assert guess(pool, *CASES[2][:3]).startswith(CASES[2][4])


FLIGHT = {"type": "object", "properties": {"aircraft": {"type": "string"}}, "required": ["aircraft"],
          "additionalProperties": False}


def test_a_name_with_capitals_and_digits_is_a_value(pool, monkeypatch):
    """`A320` (capitals and digits: a name) may be a string value's first word, `x2` (lower-case:
    a code) may not (above); negative control: any word with a digit refused (review22 N17)."""
    message = "Log this flight: the aircraft was an A320."
    assert guess(pool, FLIGHT, message, '{"aircraft": "').startswith("A320")
    monkeypatch.setattr(field_drafts, "CODE", field_drafts.re.compile(r"\d").search)
    assert not guess(pool, FLIGHT, message, '{"aircraft": "').startswith("A")


def test_the_sentence_that_asks_for_json_is_no_value(pool, monkeypatch):
    """The words of a sentence naming JSON, up to a colon, are the request's own (`Convert this
    row to JSON ...`, `Give the JSON shopping list.`), never a value's first word (session 24);
    negative control: without the rule the guesses are those words."""
    row = "Convert this CRM row to JSON with name, born, city and occupation.\nid,full_name,city\n7,Okafor Rita,Lagos"
    items = "Our trip needs: bread x2, cheese x3. Give the JSON shopping list."
    after = '{"items": [{"item": "bread", "quantity": 2}, {"item": "cheese", "quantity": 3}, {"item": "'
    assert guess(pool, PERSON, row, '{"name": "').startswith('Okafor Rita",')
    assert guess(pool, SHOPPING, items, after) == ""
    monkeypatch.setattr(FieldDrafter, "_instruction", lambda self: frozenset())
    assert guess(pool, PERSON, row, '{"name": "').startswith("Convert")
    assert guess(pool, SHOPPING, items, after).startswith("shopping")


ONE_SENTENCE = [  # (schema, message, written, the guess): the data in the sentence naming JSON
    (PERSON, "Give me JSON for Ada Lovelace, born 1815 in London.", '{"name": "', 'Ada Lovelace",'),
    (SHOPPING, "Give me JSON for 2 apples and 3 pears.", '{"items": [{"item": "', 'apples",'),
    (SHOPPING, "Give me JSON for 2 apples and 3 pears.", '{"items": [{"item": "apples", "quantity": ', "2},"),
]


@pytest.mark.parametrize("schema, message, written, expected", ONE_SENTENCE)
def test_data_in_the_sentence_naming_json_is_still_guessed(pool, schema, message, written, expected, monkeypatch):
    """review24 N13: where the request is that one sentence, the words after `JSON` are its data
    (the words before it are still the request's); negative control: every word of the sentence
    the request's (87e9d74's rule) loses the guess."""
    assert guess(pool, schema, message, written).startswith(expected)
    monkeypatch.setattr(field_drafts, "_data_elsewhere", lambda after, outside: True)
    assert not guess(pool, schema, message, written).startswith(expected)
