"""Where a field-drafted draft ends (decoding/certain_drafts.py `cut_values`; issue 30, session 23):
at the first value start the target reaches with a probability below REACH, r^j for the j-th
value start, r the row's rate of values accepted whole once reached (a prior before its own
evidence). Candidates behind a rejection cost the verifying forward as much as accepted ones.
1. With no evidence the draft spans a few values; after rejected values it ends after one;
   it keeps the opening of the value it ends at (` "`: the target's next token is the value's
   first, session 24); `count_values` counts each value the target reached and took whole.
2. In a run where the scripted target writes values the prompt does not give: the output is
   plain constrained decoding's, with fewer positions computed than with every draft kept whole
   (the negative control: REACH 0).
"""

from types import SimpleNamespace

from fixtures import four_level_fixtures
from test_field_drafts import scripted_answer, scripted_run
from test_field_guesses import SHOPPING

from specrouter.decoding import certain_drafts
from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.engine.constrained import _text_codec

pool, prompts = four_level_fixtures()
WRITTEN = '{"items": [{"item": "'
DRAFT = ('apples", "quantity": 4}, {"item": "pears", "quantity": 6}, {"item": "plums", "quantity": 5}, '
         '{"item": "figs", "quantity": 2}]}')


def cut(pool, reached=0, taken=0):
    encode, decode, special = _text_codec(pool.tokenizer)
    fields = FieldDrafter(encode, decode, encode("Buy apples, pears, plums and figs."), special)
    fields.values_reached, fields.values_taken = reached, taken
    w = SimpleNamespace(cand=encode(DRAFT), forced=[2, 3], seq=SimpleNamespace(output_ids=encode(WRITTEN)), values=[])
    certain_drafts.cut_values(w, fields)
    return decode(w.cand), w


def test_a_draft_ends_where_its_values_are_unlikely_to_be_reached(pool, monkeypatch):
    # no evidence: r = 0.7, reached 0.7, 0.49, 0.34, then 0.24 < 0.3 at the fourth value start
    text, w = cut(pool)
    assert text == 'apples", "quantity": 4}, {"item": "pears", "quantity": 6}, {"item": "'  # the opening kept
    assert len(w.values) == 4 and w.forced == [2, 3]
    # a row whose values were rejected (4 reached, none taken): r = 0.23 < 0.3 at the first start
    text, w = cut(pool, reached=4, taken=0)
    assert text == 'apples", "quantity": '
    # negative controls: cut before the value's opening (session 23), never cut
    monkeypatch.setattr(certain_drafts, "_past_opening", lambda decode, tokens, at: at)
    assert cut(pool)[0] == 'apples", "quantity": 4}, {"item": "pears", "quantity": 6}, {"item":'
    assert cut(pool, reached=4, taken=0)[0] == 'apples", "quantity":'
    monkeypatch.setattr(certain_drafts, "REACH", 0.0)
    assert cut(pool, reached=4, taken=0)[0] == DRAFT


def test_values_reached_and_taken_are_counted():
    fields = SimpleNamespace(values_reached=0, values_taken=0)
    certain_drafts.count_values(fields, [3, 8, 14], 10)  # the first value taken, the second reached only
    assert (fields.values_reached, fields.values_taken) == (2, 1)
    certain_drafts.count_values(fields, [3, 8, 14], 2)  # rejected before the first value
    assert (fields.values_reached, fields.values_taken) == (2, 1)


ANSWER = '{"items": [{"item": "apples", "quantity": 4}, {"item": "kiwis", "quantity": 6}, {"item": "figs", "quantity": 9}]}'


def test_cut_drafts_stay_exact_and_compute_fewer_positions(pool, monkeypatch):
    prompt_ids, script, _ = scripted_answer(pool, "Buy apples, pears, plums and figs.", ANSWER, SHOPPING)
    fed = []
    out, forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"), schema=SHOPPING, fed=fed)
    monkeypatch.setattr(certain_drafts, "REACH", 0.0)  # negative control: every draft whole
    whole, whole_forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"), schema=SHOPPING, fed=fed)
    assert out == whole == script  # exact: plain constrained decoding's output
    # 273 positions against 290 (12 target forwards each) on this commit
    assert fed[0] < fed[1], (forwards, whole_forwards, fed)
