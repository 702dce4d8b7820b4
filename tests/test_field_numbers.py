"""A number value's first-word guess (decoding/field_drafts.py, step 3; issue 30, session 24), on
the tiny byte-level tokenizer:
1. a number written as a word is guessed as its digits (`a ten day forecast`: `10`);
2. a number right before its key's word (its unit: `ten day`, `3 days`) comes before the number
   nearest the last value (`2 people` after `Paris`).
Each with the rule taken out as its negative control."""

import pytest
from fixtures import four_level_fixtures
from test_field_guesses import guess
from test_field_values import WEATHER

from specrouter.decoding import field_drafts
from specrouter.decoding.field_drafts import FieldDrafter

pool, prompts = four_level_fixtures()

UNIT = "Call get_weather: a ten day forecast for the city of Paris, in celsius, 2 people."
SO_FAR = '{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius", "days": '


def test_a_number_word_before_its_unit_is_guessed_as_digits(pool, monkeypatch):
    assert guess(pool, WEATHER, UNIT, SO_FAR % "Paris") == "10}}"
    monkeypatch.setattr(field_drafts, "NUMBERS", {})  # negative control: number words are no numbers
    assert guess(pool, WEATHER, UNIT, SO_FAR % "Paris") == "2}}"


def test_negative_control_without_the_unit_anchor_the_nearest_number_is_guessed(pool, monkeypatch):
    first = FieldDrafter._first_words

    def nearest_only(self, text, quoted):  # the key's words renamed: no key-anchored guess
        return first(self, text.replace('"days"', '"span"'), quoted)

    monkeypatch.setattr(FieldDrafter, "_first_words", nearest_only)
    assert guess(pool, WEATHER, UNIT, SO_FAR % "Paris") == "2}}"

