"""Where a value's copy from the prompt ends and which word it copies (decoding/field_drafts.py,
step 2; issue 30, session 24), on the tiny byte-level tokenizer:
1. a name (a capitalised word in the prompt) goes on through capitalised words only (`Gothenburg`
   of `Gothenburg since I was born`; `Bank of America` whole);
2. a copy ends before `and` / `or` followed by an article or a number: another item (`lemons`
   of `lemons and a dozen eggs`; `salt and pepper` whole);
3. a value so far is looked for as written first (`O` copies `Okafor`, not `occupation`), then in
   any case (`tokyo` copies `Tokyo`).
Each with the rule taken out as its negative control."""

import pytest
from fixtures import four_level_fixtures
from test_field_guesses import SHOPPING, guess

from specrouter.decoding import field_drafts
from specrouter.decoding.field_drafts import FieldDrafter

pool, prompts = four_level_fixtures()

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "city"], "additionalProperties": False}
LETTER = "Fill in: I have lived in Gothenburg since I was born, at the Bank of America office."
CAKE = "For the cake I still have to buy sugar, salt and pepper, lemons and a dozen eggs."
CRM = "Convert this row with name and occupation: 40213,Okafor,Rita,Tokyo"
CASES = [  # (schema, message, written, the draft, the draft without the rule (the same: one it leaves alone), the rule)
    (PERSON, LETTER, '{"name": "Ann", "city": "Goth', 'enburg"}', 'enburg since I"}', "_name"),
    (PERSON, LETTER, '{"name": "Ann", "city": "Bank', ' of America"}', ' of America office"}', "_name"),
    (SHOPPING, CAKE, '{"items": [{"item": "lem', 'ons",', 'ons and a dozen",', "CLAUSE"),
    (SHOPPING, CAKE, '{"items": [{"item": "sal', 't and pepper",', 't and pepper",', "CLAUSE"),
    (PERSON, CRM, '{"name": "O', 'kafor",', 'ccupation",', "_find"),
    (PERSON, CRM, '{"name": "Rita", "city": "tok', 'yo"}', 'yo"}', "_find"),
]
WITHOUT = {
    "_name": lambda mp: mp.setattr(FieldDrafter, "_name", staticmethod(lambda rest: rest)),
    "CLAUSE": lambda mp: mp.setattr(field_drafts, "CLAUSE", field_drafts.re.compile(
        r"\s(?:who|which|that|where|when|in|at|from|for|with|on|over|to|was|is|born)\b|\s\S*\d", field_drafts.re.I)),
    "_find": lambda mp: mp.setattr(FieldDrafter, "_find", lambda self, f, cased=None, find=FieldDrafter._find:
                                   find(self, f)),
}


@pytest.mark.parametrize("schema, message, written, expected, without, rule", CASES)
def test_a_copy_ends_and_starts_where_the_value_does(pool, schema, message, written, expected, without, rule,
                                                     monkeypatch):
    assert guess(pool, schema, message, written) == expected
    WITHOUT[rule](monkeypatch)  # negative control
    assert guess(pool, schema, message, written) == without
