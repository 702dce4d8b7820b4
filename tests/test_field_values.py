"""Field drafts where the model's values are not the prompt's words (decoding/field_drafts.py;
issue 30, session 23), on the tiny byte-level tokenizer:
1. the model's own value (a quantity the prompt does not give, `cucumbers` for `cucumber`): its
   end is drafted (`},`, `",`) where nothing was;
2. a value's first word is the first guess the grammar allows whole (an enum's `celsius` after a
   guess of `days`), cased as the values before it where the grammar allows it;
3. the last value is placed in the prompt by a stem where it is not found whole (`cucumbers` at
   `cucumber`), so the next value's guess is the word after it, and a written word's stem is used;
4. in a run: a scripted target writes quantities the prompt does not give: the output is plain
   constrained decoding's, in fewer target forwards than without the end guess;
5. a string of the model's own gets its end drafted only where it left the prompt's text or
   where it ends a word of the prompt (session 24), not inside a word it is still writing (a
   CRM cell written on as `Hygienist, Lag`: the drafter's tokens stand there).
Each with the rule taken out as its negative control."""

import itertools

import pytest
from fixtures import four_level_fixtures
from test_field_drafts import scripted_answer, scripted_run
from test_field_guesses import SHOPPING, guess

from specrouter.decoding import field_drafts
from specrouter.decoding.field_drafts import FieldDrafter

WEATHER = {"type": "object", "properties": {
    "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city", "unit", "days"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
SALAD = "Make a JSON list for a salad: 1 lettuce, 2 tomatoes, 1 cucumber, 1 onion."
SO_FAR = '{"items": [{"item": "lettuce", "quantity": 1}, {"item": "tomatoes", "quantity": 2}, {"item": "cucumbers'
WEATHER_ASK = "Call get_weather: what will the weather be in Paris for the next 3 days, in celsius?"

pool, prompts = four_level_fixtures()


OWN = [  # (written, the draft): values the prompt does not hold
    (SO_FAR[: SO_FAR.index("1}")] + "10", "},"),  # a quantity of the model's
    (SO_FAR, '",'),  # `cucumbers`: the prompt says `cucumber,`
]


@pytest.mark.parametrize("written, expected", OWN)
def test_the_models_own_value_ends_here(pool, written, expected):
    assert guess(pool, SHOPPING, SALAD, written).startswith(expected)


def test_negative_control_without_the_end_guess_nothing_is_drafted(pool, monkeypatch):
    copy = FieldDrafter._copy
    monkeypatch.setattr(FieldDrafter, "_copy", lambda self, m, tokens, fragment, value, quoted:
                        [] if self._find(value.lower()) < 0 else copy(self, m, tokens, fragment, value, quoted))
    for written, _ in OWN:
        assert guess(pool, SHOPPING, SALAD, written) == ""


def test_a_first_word_guess_the_grammar_refuses_gives_way_to_one_it_allows(pool, monkeypatch):
    written = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "'
    assert guess(pool, WEATHER, WEATHER_ASK, written) == "celsius"  # not `days`, not `Celsius`
    first = FieldDrafter._first_words  # negative control: the first guess only (`days`, refused)
    monkeypatch.setattr(FieldDrafter, "_first_words", lambda self, text, quoted:
                        itertools.islice(first(self, text, quoted), 1))
    assert guess(pool, WEATHER, WEATHER_ASK, written) == ""


STEMS = [  # (written, the guess, the guess without stems)
    (SO_FAR + '", "quantity": 1}, {"item": "', 'onion",', 'cucumber'),  # the next item, not `cucumber` again
    (SO_FAR + '", "quantity": ', "1}", "2}"),  # the number beside `cucumber`, not beside `tomatoes`
]


@pytest.mark.parametrize("written, expected, without", STEMS)
def test_a_value_is_placed_by_its_stem(pool, written, expected, without, monkeypatch):
    assert guess(pool, SHOPPING, SALAD, written).startswith(expected)
    monkeypatch.setattr(field_drafts, "STEM", 0)  # negative control
    assert guess(pool, SHOPPING, SALAD, written).startswith(without)


ANSWER = '{"items": [{"item": "apples", "quantity": 4}, {"item": "pears", "quantity": 6}, {"item": "plums", "quantity": 5}]}'


def test_own_values_ends_save_forwards_and_stay_exact(pool, monkeypatch):
    prompt_ids, script, _ = scripted_answer(pool, "Buy apples, pears and plums.", ANSWER, SHOPPING)
    on, forwards, proposed = scripted_run(pool, prompt_ids, script, ("ngram", "target"), schema=SHOPPING)
    assert on == script and proposed > 0  # exact: plain constrained decoding's output
    copy = FieldDrafter._copy  # negative control: no draft where the value is not in the prompt
    monkeypatch.setattr(FieldDrafter, "_copy", lambda self, m, tokens, fragment, value, quoted:
                        [] if self._find(value.lower()) < 0 else copy(self, m, tokens, fragment, value, quoted))
    off, off_forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"), schema=SHOPPING)
    assert off == script
    assert forwards < off_forwards, (forwards, off_forwards)  # 7 against 13 on this commit


CRM = "Convert this CRM row to JSON: Okafor,Rita,Dental Hygienist,Lagos,1988"
OCCUPATION = {"type": "object", "properties": {"occupation": {"type": "string"}}, "required": ["occupation"],
              "additionalProperties": False}
OWN_STRINGS = [  # (written, the draft, the draft where every own value's end is drafted)
    ('{"occupation": "Dental Hygienist, Lag', "", '"}'),  # inside a word: nothing
    ('{"occupation": "Dental Hygienist, Lagos', '"}', '"}'),  # it ends a word of the prompt
    ('{"occupation": "Dental Hygienists', '"}', '"}'),  # where it left the prompt's text
]


@pytest.mark.parametrize("written, expected, every", OWN_STRINGS)
def test_an_own_strings_end_is_drafted_where_it_left_the_prompt_or_ends_a_prompt_word(pool, written, expected,
                                                                                       every, monkeypatch):
    assert guess(pool, OCCUPATION, CRM, written) == expected
    monkeypatch.setattr(FieldDrafter, "_own_end", lambda self, tokens, value: True)  # negative control
    assert guess(pool, OCCUPATION, CRM, written) == every
