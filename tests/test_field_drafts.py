"""Field drafts of constrained rows (issue 30, decoding/field_drafts.py).

1. What a field draft proposes, on the tiny byte-level tokenizer and a JSON schema, at each
   kind of place in the output: a value's rest copied from the prompt with its end, a number
   after its key's words (key-anchored), the next value after the last one's place in the
   prompt (cursor), a capitalised guess where every value so far was capitalised; nothing where
   the value's text is not in the prompt; every draft is one the grammar accepts.
2. Exact: with field drafts (the default), greedy and seeded outputs of model-free chains equal
   plain constrained decoding token for token, and field drafts were proposed; with
   `ChainExecutor.field_drafts = False` none are (the switch the benchmark compares).
"""

import pytest
from fixtures import four_level_fixtures

from specrouter.config import SamplingParams
from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.grammar import GrammarSpec, RowGrammar
from specrouter.engine.constrained import _text_codec
from specrouter.engine.engine import Engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
    "occupation": {"type": "string"}}, "required": ["name", "born", "city", "occupation"],
    "additionalProperties": False}
RECORD = "Extract the record: Ada Lovelace, born 1815 in London, was a mathematician who wrote programs."

pool, prompts = four_level_fixtures()


@pytest.fixture(scope="module")
def drafter(pool):
    tok = pool.tokenizer
    encode, decode, special = _text_codec(tok)
    prompt = encode(RECORD)
    grammar = RowGrammar(GrammarSpec.json_schema(PERSON), tok, tuple(pool.eos_ids), pool.vocab_width,
                         frozenset(pool.eos_ids))
    return FieldDrafter(encode, decode, prompt, special), grammar, encode, decode


@pytest.mark.parametrize("written, expected", [
    ('{"name": "Ad', 'a Lovelace",'),  # the value's rest, then its end
    ('{"name": "', 'Ada Lovelace",'),  # a capitalised word after the instruction's colon
    ('{"name": "Ada Lovelace", "born": ', "1815,"),  # key-anchored: `born 1815`
    ('{"name": "Ada Lovelace", "born": 1815, "city": "', 'London",'),  # the next capitalised word
    ('{"name": "Ada Lovelace", "born": 1815, "city": "London", "occupation": "',
     'Mathematician"}'),  # capitalised as the values before it; stops before `who`
    ('{"name": "Ada Lovelace", "born": 1815, "city": "London", "occupation": "mat', 'hematician"}'),
    ('{"name": "Grace', ""),  # not in the prompt: nothing
])
def test_a_field_draft_copies_the_prompt_where_the_output_is(drafter, written, expected):
    fields, grammar, encode, decode = drafter
    generated = encode(written)
    assert grammar.valid_prefix([], generated) == len(generated)
    draft = fields.propose(grammar, generated, [], 16)
    assert decode(draft) == expected
    assert grammar.valid_prefix(generated, draft) == len(draft)  # the grammar accepts it
    # the same draft after a draft path: the path is the first tokens, the draft the rest
    cut = len(generated) // 2
    assert decode(fields.propose(grammar, generated[:cut], generated[cut:], 16)) == expected


def test_a_field_draft_stops_at_forced_tokens_and_honours_k(drafter):
    fields, grammar, encode, decode = drafter
    generated = encode('{"name": "Ad')
    assert decode(fields.propose(grammar, generated, [], 2)) == decode(encode('a Lovelace",')[:2])
    # after the value's end the grammar forces `"born": ...`: the certain candidates, not a field draft
    generated = encode('{"name": "Ada Lovelace",')
    forced = grammar.forced_tokens(generated, 8)
    assert forced and fields.propose(grammar, generated, [], 8) == []


# -- 2. exact ---------------------------------------------------------------------------------
def run(pool, prompt_ids, params, chain, fields=True):
    engine = Engine(pool)
    engine.executor.field_drafts = fields
    seqs = engine.generate_ids(prompt_ids, [params] * len(prompt_ids), chain=chain, k=5)
    return [s.output_ids for s in seqs], sum(s.grammar.fields.proposed for s in seqs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_with_field_drafts_equal_plain_constrained_decoding(pool, prompts, temperature):
    encode = _text_codec(pool.tokenizer)[0]
    prompt_ids = [encode(RECORD), encode("Note: Alan Turing, born 1912 in London."), *prompts[:1]]
    params = SamplingParams(max_new_tokens=48, temperature=temperature, seed=5,
                            grammar=GrammarSpec.json_schema(PERSON))
    engine = Engine(pool)
    engine.jump_forward = False
    expected = [s.output_ids for s in engine.generate_ids(prompt_ids, [params] * 3, chain=("target",))]
    proposed = 0
    for chain in (("ngram", "target"), ("ngram", "draft", "target"), ("ngram", "same", "target")):
        got, n = run(pool, prompt_ids, params, chain)
        assert got == expected, chain
        proposed += n
    assert proposed > 0  # field drafts did enter the chains
    got, n = run(pool, prompt_ids, params, ("ngram", "target"), fields=False)
    assert got == expected and n == 0
