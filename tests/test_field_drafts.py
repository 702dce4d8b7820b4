"""Field drafts of constrained rows (issue 30, decoding/field_drafts.py).

1. What a field draft proposes, on the tiny byte-level tokenizer and a JSON schema, at each
   kind of place in the output: a value's rest copied from the prompt with its end, a number
   after its key's words (key-anchored), the next value after the last one's place in the
   prompt (cursor), a capitalised guess where every value so far was capitalised; the value's end
   where its text is not in the prompt (the model's own value); every draft is one the grammar
   accepts.
2. Exact: with field drafts (the default), greedy and seeded outputs of model-free chains equal
   plain constrained decoding token for token, and field drafts were proposed; with
   `ChainExecutor.field_drafts = False` none are (the switch the benchmark compares).
3. Accepted: the random targets above reject every field draft, so (review21 D2) a scripted
   target writes the record's JSON and field drafts are accepted across fields: the output is
   plain constrained decoding's, with fewer target forwards than without field drafts; negative
   controls: a commit bug on long acceptances changes the output only here, and field drafts
   proposed one token late save no forwards.
"""

import pytest
from fixtures import four_level_fixtures

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_module
from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.grammar import GrammarSpec, RowGrammar
from specrouter.engine.constrained import _text_codec
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool

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
    ('{"name": "Countess Ada', '",'),  # not in the prompt (the model's own value), ending a word of it: its end
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


# -- 3. accepted across fields ----------------------------------------------------------------
# The tiny random targets reject every field draft (they write `{"name": "NNNN...`), so the test
# above would pass with a field draft's bookkeeping wrong. Here the target writes the record's
# JSON: a scripted target whose argmax is the canonical tokenization of ANSWER (then EOS) while
# the output follows it, so field drafts are accepted across several fields in one cycle.
ANSWER = '{"name": "Ada Lovelace", "born": 1815, "city": "London", "occupation": "Mathematician"}'


class ScriptedTarget:
    """Wraps the target runner (its KV and every attribute but `forward`'s logits): where a row's
    tokens so far are a prompt of `scripts` and a prefix of its script, the script's next token
    gets the largest logit (a function of the tokens only, as a model's logits are). Counts
    forwards. Chains only (no token trees)."""

    supports_trees = False

    def __init__(self, inner, scripts: dict[tuple, list[int]]):
        self.__dict__.update(_inner=inner, _scripts=scripts, _history={}, forwards=0, fed=0)

    def forward(self, batch):
        self.__dict__["forwards"] += 1
        self.__dict__["fed"] += sum(batch.num_tokens_list)  # positions the target computed
        logits = self._inner.forward(batch).clone()  # (an inference tensor: not written in place)
        for b, (slot, start, n) in enumerate(zip(batch.slots_list, batch.starts_list, batch.num_tokens_list)):
            seen = self._history.get(slot, [])
            assert len(seen) >= start, "the cache holds tokens this wrapper never saw"
            seen = self._history[slot] = seen[:start] + batch.tokens[b, :n].tolist()
            for g, pos in enumerate(batch.logit_positions[b].tolist()):
                context = tuple(seen[: start + pos + 1])
                for prompt, script in self._scripts.items():
                    full = prompt + tuple(script)
                    if len(prompt) <= len(context) < len(full) and full[: len(context)] == context:
                        logits[b, g, full[len(context)]] = logits[b, g].max() + 50.0
        return logits

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def __setattr__(self, attr, value):
        setattr(self._inner, attr, value)


def scripted_run(pool, prompt_ids, script, chain, fields=True, jump_forward=True, schema=PERSON, fed=None):
    """(output ids, target forwards, field-draft tokens proposed) of one greedy row; `fed`: a list
    the positions the target computed are appended to."""
    target = ScriptedTarget(pool.runners[pool.target], {tuple(prompt_ids): script})
    runners = {**pool.runners, pool.target: target}
    scripted = Pool(runners=runners, drafters=pool.drafters, order=pool.order, target=pool.target,
                    tokenizer=pool.tokenizer, eos_ids=pool.eos_ids, vocab_width=pool.vocab_width)
    engine = Engine(scripted.with_fresh_drafters())
    engine.jump_forward = jump_forward
    engine.executor.field_drafts = fields
    params = SamplingParams(max_new_tokens=128, temperature=0.0, grammar=GrammarSpec.json_schema(schema))
    seq = engine.generate_ids([prompt_ids], [params], chain=chain, k=8)[0]
    if fed is not None:
        fed.append(target.fed)
    return seq.output_ids, target.forwards, seq.grammar.fields.proposed


def scripted_answer(pool, record, answer, schema=PERSON):
    """(prompt ids, script, plain constrained decoding's target forwards) of a scripted target
    writing `answer` (then EOS) for `record`, checked grammar-valid: plain constrained decoding
    (no jump forward) writes it whole."""
    encode, decode = _text_codec(pool.tokenizer)[:2]
    prompt_ids, script = encode(record), encode(answer) + [pool.eos_ids[0]]
    plain, plain_forwards, _ = scripted_run(pool, prompt_ids, script, ("target",), jump_forward=False, schema=schema)
    assert plain == script, decode(plain)  # the scripted target writes the answer (grammar-valid)
    return prompt_ids, script, plain_forwards


@pytest.fixture(scope="module")
def scripted(pool):
    return scripted_answer(pool, RECORD, ANSWER)


def test_field_drafts_accepted_across_fields_are_exact_and_save_forwards(pool, scripted):
    prompt_ids, script, plain_forwards = scripted
    on, on_forwards, proposed = scripted_run(pool, prompt_ids, script, ("ngram", "target"))
    off, off_forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"), fields=False)
    assert on == off == script  # (1) exact: plain constrained decoding's output
    # (2) accepted: 7 target forwards against 12 without field drafts (79 plain) on this commit
    assert proposed > 0 and on_forwards < off_forwards, (on_forwards, off_forwards, plain_forwards)


def test_negative_control_a_commit_bug_on_long_acceptances_fails_the_equality(pool, scripted, monkeypatch):
    """(3) A commit that drops the last accepted token where a cycle accepted more than k = 8
    candidates (only a draft that spans fields with forced tokens does) changes the output with
    field drafts; without them no cycle accepts so many, and the same bug goes unseen (as it did
    with the random targets: the check needs accepted field drafts)."""
    prompt_ids, script, _ = scripted
    verify_rows = executor_module.verify_rows

    def shifted(cands, tokens):
        return [out[: len(out) - 2] + out[-1:] if len(out) - 1 > 8 else out
                for out in verify_rows(cands, tokens)]

    monkeypatch.setattr(executor_module, "verify_rows", shifted)
    assert scripted_run(pool, prompt_ids, script, ("ngram", "target"), fields=False)[0] == script
    assert scripted_run(pool, prompt_ids, script, ("ngram", "target"))[0] != script


def test_negative_control_misplaced_field_drafts_save_no_forwards(pool, scripted, monkeypatch):
    """A field draft proposed one token late (its first token dropped) is rejected: the forward
    check (2) fails, output stays exact (verification)."""
    prompt_ids, script, _ = scripted
    propose = FieldDrafter.propose
    monkeypatch.setattr(FieldDrafter, "propose", lambda self, *a: propose(self, *a)[1:])
    on, on_forwards, proposed = scripted_run(pool, prompt_ids, script, ("ngram", "target"))
    off, off_forwards, _ = scripted_run(pool, prompt_ids, script, ("ngram", "target"), fields=False)
    assert on == off == script and proposed > 0
    assert on_forwards >= off_forwards, (on_forwards, off_forwards)
