"""Which draft a constrained row verifies: a model-free drafter's proposal or its field draft
(decoding/certain_drafts.py `preferred`, issue 30).

1. At one place: a proposal that differs from the field draft gives way to it (whatever their
   lengths); one that agrees with every field draft on its path and goes on is kept; one that
   agrees with the field draft, passes the forced tokens and then differs from the next field
   draft keeps its agreeing part and takes the next field draft from there; one with no field
   draft to compare is kept.
2. In a run: the prompt holds an example record, so the n-gram drafter proposes the example's
   values (longer than a field draft) where the scripted target writes the record's: the output
   is plain constrained decoding's, in fewer target forwards than when the longer proposal wins
   (the rule before session 22: the negative control).
"""

import pytest
from fixtures import four_level_fixtures
from test_field_drafts import ANSWER, PERSON, scripted_answer, scripted_run
from test_field_guesses import SHOPPING

from specrouter.decoding import certain_drafts
from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.grammar import GrammarSpec, RowGrammar
from specrouter.decoding.json_scan import JsonScan
from specrouter.engine import drafts as engine_drafts
from specrouter.engine.constrained import _text_codec

EXAMPLE = '{"name": "Grace Hopper", "born": 1906, "city": "New York", "occupation": "Admiral"}'
RECORD = ("Example: " + EXAMPLE + " Extract the record: Ada Lovelace, born 1815 in London, was a "
          "mathematician who wrote programs.")

pool, prompts = four_level_fixtures()


@pytest.fixture(scope="module")
def row(pool):
    encode, decode, special = _text_codec(pool.tokenizer)
    grammar = RowGrammar(GrammarSpec.json_schema(PERSON), pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width,
                         frozenset(pool.eos_ids))
    grammar.fields = FieldDrafter(encode, decode, encode(RECORD), special)
    return grammar, encode, decode


@pytest.mark.parametrize("written, own, expected", [
    # differs from the field draft (longer: an earlier record's value): the field draft
    ('{"name": "', 'Grace Hopper", "born": 1906', 'Ada Lovelace",'),
    # shorter and different: the field draft too
    ('{"name": "', 'Al', 'Ada Lovelace",'),
    # stops inside the field draft: the field draft (it goes further along the same path)
    ('{"name": "', 'Ada', 'Ada Lovelace",'),
    # the field draft, the forced `"born": `, then another value: the agreeing part, then the field draft
    ('{"name": "', 'Ada Lovelace", "born": 1906', 'Ada Lovelace", "born": 1815,'),
    # agrees all along and goes on: kept
    ('{"name": "', 'Ada Lovelace", "born": 1815, "ci', 'Ada Lovelace", "born": 1815, "ci'),
])
def test_a_proposal_gives_way_where_it_differs_from_a_field_draft(row, written, own, expected):
    grammar, encode, decode = row
    generated, own_ids = encode(written), encode(own)
    assert grammar.valid_prefix(generated, own_ids) == len(own_ids)
    got = certain_drafts.preferred(grammar, generated, [], own_ids, 32)
    assert decode(got) == expected
    assert grammar.valid_prefix(generated, got) == len(got)  # a path the grammar accepts
    # after a draft path: the same, the path left as it is
    cut = len(generated) // 2
    assert decode(certain_drafts.preferred(grammar, generated[:cut], generated[cut:], own_ids, 32)) == expected


def test_a_proposal_with_no_field_draft_to_compare_is_kept(pool):
    encode, decode, special = _text_codec(pool.tokenizer)
    grammar = RowGrammar(GrammarSpec.json_schema(SHOPPING), pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width,
                         frozenset(pool.eos_ids))
    grammar.fields = FieldDrafter(encode, decode, encode("Buy 2 apples and 3 pears."), special)
    generated = encode('{"items": [')  # an item's object starts: no value, no field draft
    own = encode('{"')
    assert grammar.fields.propose(grammar, generated, [], 16) == []
    assert certain_drafts.preferred(grammar, generated, [], own, 16) is own


def test_after_a_value_with_no_field_draft_the_next_values_field_draft_is_compared(pool):
    """No field draft for the year (the prompt has none), then the drafter's `"city": "Paris"`
    differs from the field draft `London",`: the walk passes the forced key text after `,` (and
    the space after `:`) to the value's start and gives way there (it used to stop where the
    grammar forces text, find no field draft, and skip the value: review22 D6)."""
    encode, decode, special = _text_codec(pool.tokenizer)
    grammar = RowGrammar(GrammarSpec.json_schema(PERSON), pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width,
                         frozenset(pool.eos_ids))
    grammar.fields = FieldDrafter(encode, decode, encode("Extract the record: Ada Lovelace of London, a "
                                                         "mathematician."), special)
    generated = encode('{"name": "Ada Lovelace", "born":')
    own = encode(' 1906, "city": "Paris"')
    assert grammar.fields.propose(grammar, generated, [], 16) == []
    got = certain_drafts.preferred(grammar, generated, [], own, 32)
    assert decode(got) == ' 1906, "city": "London",'
    assert grammar.valid_prefix(generated, got) == len(got)
    agreeing = encode(' 1906, "city": "London", "occ')
    assert certain_drafts.preferred(grammar, generated, [], agreeing, 32) is agreeing


def longer_wins(grammar, generated, path, own, budget):
    """The rule before session 22: the field draft only where longer than the proposal."""
    draft = grammar.fields.propose(grammar, generated, path, budget)
    return draft if len(draft) > len(own) else own


@pytest.fixture(scope="module")
def example_record(pool):
    return scripted_answer(pool, RECORD, ANSWER)[:2]


def test_field_drafts_preferred_to_a_copied_example_save_forwards(pool, example_record, monkeypatch):
    prompt_ids, script = example_record
    out, forwards, proposed = scripted_run(pool, prompt_ids, script, ("ngram", "target"))
    assert out == script and proposed > 0  # exact: plain constrained decoding's output
    monkeypatch.setattr(certain_drafts, "preferred", longer_wins)  # negative control (the drafts,
    monkeypatch.setattr(engine_drafts, "preferred", longer_wins)  # and the router's shadow proposals)
    old, old_forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"))
    assert old == script
    assert forwards < old_forwards, (forwards, old_forwards)  # 5 against 7 on this commit


def test_a_value_starts_after_a_separator_outside_strings_only(row):
    """The walk's next value start: after the next key's `:`, not after the `,` inside the string
    `London, England` (review22 N9: a field draft proposed there was wasted); negative control:
    the same tokens read as if outside a string (in an array) stop at that comma."""
    grammar, encode, decode = row
    tokens = encode('London, England", "occupation": "Math')
    at = certain_drafts._next_value_start(decode, tokens, 0, JsonScan().feed('{"name": "Ada", "born": 1815, "city": "'))
    assert decode(tokens[:at]) == 'London, England", "occupation":'
    at = certain_drafts._next_value_start(decode, tokens, 0, JsonScan().feed("["))
    assert decode(tokens[:at]) == "London,"
