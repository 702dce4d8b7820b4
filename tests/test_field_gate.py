"""The per-request gate on field drafts (issue 30, session 25: decoding/field_gate.py).

1. The gate's bookkeeping: a contest is scored only once the row has committed the tokens at
   its positions (both sides then judged in full; the negative control of scoring it at once,
   against the cycle's own tokens: the first test's contest would be scored lost by one token,
   not three), not where its place was never reached; the score decays every drafted cycle;
   the gate closes on lost contests and opens again as they fade.
2. On a scripted target (tests/test_field_drafts.py's), greedy, ("ngram", "target"):
   - a request whose guesses fail (the output is a list that repeats one item the prompt does
     not name: the n-gram drafter copies it, every guess is another item of the prompt) closes
     the gate, and the row then takes fewer target forwards than with the gate held open;
   - a request whose guesses succeed (the record's JSON) keeps it open and every guess offered;
   - the outputs are plain constrained decoding's either way (exact whatever the gate decides);
   - negative control: a contest recorded with its sides swapped fails both. (Scoring contests
     at once still closes the gate on this loop (review25 D2): only section 1 tells the two
     scorings apart.)
3. The call sites that follow the gate, at the looping row's first item with an oracle drafter
   (the script's next tokens up to the next forced one): with the gate closed the executor drafts
   exactly what it drafts with field drafts off (the drafter re-asked FREE_ROUNDS times after
   forced tokens, not FIELD_ROUNDS; no `cut_values`) and the router's shadow proposal is the
   drafter's own; with it open both are the field draft. Each fails when its call site ignores
   the gate (engine/drafts.py `shadow_proposals`, certain_drafts.py `propose_after_forced`,
   executor.py `_propose`: /work/notes/tools/gatetest25/mutate.sh).
"""

import pytest
import torch
from fixtures import four_level_fixtures
from test_field_drafts import ANSWER, PERSON, RECORD, ScriptedTarget, scripted_answer

from specrouter.config import SamplingParams
from specrouter.decoding import certain_drafts, field_gate
from specrouter.decoding.field_gate import Contest, FieldGate
from specrouter.decoding.grammar import GrammarSpec
from specrouter.engine import drafts as engine_drafts
from specrouter.engine.constrained import _text_codec, attach
from specrouter.engine.engine import Engine
from specrouter.models.pool import Pool
from specrouter.state.sequence import Sequence

pool, prompts = four_level_fixtures()

SHOPPING = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
    "required": ["item", "quantity"], "additionalProperties": False}, "maxItems": 5}},
    "required": ["items"], "additionalProperties": False}
LIST = "Make a list of what we need: 2 apples, 3 pears, 1 plum, 4 figs, 5 limes and 6 kiwis."
LOOP = '{"items": [' + ", ".join(['{"item": "tea", "quantity": 1}'] * 5) + "]}"


# -- 1. bookkeeping ---------------------------------------------------------------------------
def test_a_contest_is_scored_once_its_positions_are_committed():
    gate = FieldGate()
    c = Contest(at=3, before=[7], fields=[1, 2], own=[5, 6, 8], offered=True)
    gate.observe(c, [0, 0], [7, 5])  # committed up to position 3 only: the proposal's tail not yet
    assert gate.contests == 0 and gate.pending == [c]
    gate.observe(None, [0, 0, 7, 5], [6, 8])
    assert (gate.contests, gate.lost, gate.pending) == (1, 1, [])
    assert gate.score == pytest.approx(-3.0)  # the proposal's 3 tokens, in full, against none


def test_a_contest_whose_place_was_never_reached_is_not_scored():
    gate = FieldGate()
    gate.observe(Contest(at=3, before=[7], fields=[1], own=[5], offered=True), [0, 0], [9, 5, 5])
    assert gate.contests == 0 and gate.pending == [] and gate.score == 0.0


def test_the_gate_closes_on_lost_contests_and_opens_as_they_fade():
    gate = FieldGate()
    assert gate.open
    for _ in range(2):
        gate.observe(Contest(at=0, before=[], fields=[1, 2], own=[5, 6], offered=gate.open), [], [5, 6])
    assert not gate.open and gate.lost == 2 and gate.closed == 1
    for _ in range(200):  # cycles without contests: the evidence fades toward the prior
        gate.observe(None, [], [0])
        if gate.open:
            break
    assert gate.open and gate.score > -field_gate.PRIOR


def test_won_contests_keep_it_open():
    gate = FieldGate()
    gate.observe(Contest(at=0, before=[], fields=[1, 2, 3], own=[], offered=True), [], [1, 2, 3, 4])
    assert gate.open and gate.won == 1 and gate.score == pytest.approx(3)
    gate.observe(Contest(at=0, before=[], fields=[1, 2, 3, 4, 5, 6], own=[8, 8], offered=True), [], [8] * 6)
    assert gate.open and gate.lost == 1 and gate.score == pytest.approx(3 * field_gate.DECAY - 2)


# -- 2. scripted requests ---------------------------------------------------------------------
def gated_run(pool, prompt_ids, script, schema, fields=True, chain=("ngram", "target")):
    """(output ids, target forwards, the row's gate) of one greedy row on a scripted target."""
    target = ScriptedTarget(pool.runners[pool.target], {tuple(prompt_ids): script})
    scripted = Pool(runners={**pool.runners, pool.target: target}, drafters=pool.drafters, order=pool.order,
                    target=pool.target, tokenizer=pool.tokenizer, eos_ids=pool.eos_ids, vocab_width=pool.vocab_width)
    engine = Engine(scripted.with_fresh_drafters())
    engine.executor.field_drafts = fields
    params = SamplingParams(max_new_tokens=160, temperature=0.0, grammar=GrammarSpec.json_schema(schema))
    seq = engine.generate_ids([prompt_ids], [params], chain=chain, k=8)[0]
    return seq.output_ids, target.forwards, seq.grammar.fields.gate


@pytest.fixture(scope="module")
def looping(pool):
    encode = _text_codec(pool.tokenizer)[0]
    prompt_ids, script = encode(LIST), encode(LOOP) + [pool.eos_ids[0]]
    assert gated_run(pool, prompt_ids, script, SHOPPING, chain=("target",))[0] == script  # grammar-valid
    return prompt_ids, script


def test_the_gate_closes_where_guesses_fail_and_saves_forwards(pool, looping, monkeypatch):
    prompt_ids, script = looping
    out, forwards, gate = gated_run(pool, prompt_ids, script, SHOPPING)
    assert gate.lost > gate.won and gate.closed > 0 and not gate.open
    off, off_forwards, _ = gated_run(pool, prompt_ids, script, SHOPPING, fields=False)
    monkeypatch.setattr(field_gate, "PRIOR", float("inf"))  # held open: every guess offered
    held, held_forwards, held_gate = gated_run(pool, prompt_ids, script, SHOPPING)
    assert out == off == held == script  # exact whatever is offered
    assert held_gate.closed == 0 and held_gate.lost > 0
    assert forwards < held_forwards, (forwards, held_forwards, off_forwards)


def test_the_gate_stays_open_where_guesses_succeed(pool):
    prompt_ids, script, _ = scripted_answer(pool, RECORD, ANSWER)
    out, _, gate = gated_run(pool, prompt_ids, script, PERSON)
    assert out == script
    assert gate.won > 0 and gate.lost == 0 and gate.closed == 0 and gate.open


def test_negative_control_sides_swapped_fail_both(pool, looping, monkeypatch):
    """A contest recorded with its sides swapped (the proposal's tokens as the field draft's):
    the gate stays open on the loop and closes on the record, failing both checks above."""
    def swapped(at, before, fields, own, offered):
        return Contest(at, before, own, fields, offered)

    monkeypatch.setattr(certain_drafts, "Contest", swapped)
    prompt_ids, script = looping
    out, _, gate = gated_run(pool, prompt_ids, script, SHOPPING)
    assert out == script and gate.won > gate.lost and gate.open
    prompt_ids, script, _ = scripted_answer(pool, RECORD, ANSWER)
    out, _, gate = gated_run(pool, prompt_ids, script, PERSON)
    assert out == script and gate.closed > 0


# -- 3. the call sites that follow the gate ---------------------------------------------------
class Oracle:
    """A model-free drafter that knows the row's output (`script`, after `prompt_len` prompt
    tokens): it proposes the script's next tokens up to the next one the grammar forces, as a
    drafter asked again after each run of forced tokens (certain_drafts.propose_after_forced);
    nothing where the context left the script."""

    sized_by_confidence = False

    def __init__(self, prompt_len: int, script: list[int], forced: set[int]):
        self.prompt_len, self.script, self.forced = prompt_len, script, forced

    def propose(self, contexts, k, tenants=None, min_confidence=None):
        rows = []
        for ctx, n in zip(contexts, [k] * len(contexts) if isinstance(k, int) else k):
            i = len(ctx) - self.prompt_len
            j = i
            if list(ctx[self.prompt_len:]) == self.script[:i]:
                while j < len(self.script) and j - i < n and (j == i or j not in self.forced):
                    j += 1
            rows.append(self.script[i:j])
        width = max(map(len, rows), default=0)
        return (torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width),
                torch.tensor([len(r) for r in rows]))


@pytest.fixture(scope="module")
def first_item(pool, looping):
    """(oracle, a function making the looping row at its first choice (after the forced
    `{"items": [{"item": "`) with its gate open or closed)."""
    prompt_ids, script = looping
    params = SamplingParams(max_new_tokens=160, temperature=0.0, grammar=GrammarSpec.json_schema(SHOPPING))

    def new_row() -> Sequence:
        seq = Sequence(seq_id=0, tokens=list(prompt_ids), prompt_len=len(prompt_ids), params=params,
                       stop_ids=frozenset(pool.eos_ids))
        attach(pool, seq)
        return seq

    def row(gate_open: bool) -> Sequence:
        seq = new_row()
        seq.tokens += script[:at]
        seq.grammar.fields.gate.score = 0.0 if gate_open else -10.0
        seq.grammar.fields.values_reached = 4  # none taken: a field-drafted draft ends at its first value
        return seq

    g = new_row().grammar
    forced = {i for i in range(len(script)) if g.forced_tokens(script[:i], 1) == script[i:i + 1]}
    at = [i for i in range(len(script)) if i not in forced][1]  # (the first: `{` or `]` after `[`)
    assert _text_codec(pool.tokenizer)[1](script[:at]) == '{"items": [{"item": "'
    return Oracle(len(prompt_ids), script, forced), row


def drafted(pool, oracle, seq, fields: bool, k: int = 16):
    """The RowWork of `seq` after the executor's model-free drafting on ("ngram", "target"),
    the oracle as the n-gram drafter."""
    executor = Engine(pool.with_fresh_drafters()).executor
    executor.drafters = {**executor.drafters, "ngram": oracle}
    executor.field_drafts = fields
    executor._forwards, executor._ftime, executor._fsum = [], {}, 0.0  # (a step's running totals)
    w = executor._start_row(0, seq, ("ngram", "target"), k)
    executor._propose("ngram", [w])
    return w


def test_a_closed_gate_drafts_what_no_field_drafts_draft(pool, first_item):
    """Closed: the drafter's proposal and the forced tokens, the drafter asked again FREE_ROUNDS
    times (not FIELD_ROUNDS), no value cut (cut_values: this row's values were all rejected), so
    the candidates equal those with field drafts off; open: the field draft is verified."""
    oracle, row = first_item
    off = drafted(pool, oracle, row(False), fields=False)
    assert off.cand == oracle.script[len(row(False).output_ids):][:len(off.cand)]
    assert len(off.cand) - len(off.forced) < 16  # the re-asks ran out before k: FIELD_ROUNDS would go on
    closed = drafted(pool, oracle, row(False), fields=True)
    assert closed.cand == off.cand and closed.values == []
    assert closed.contest is not None and not closed.contest.offered  # scored as a shadow
    opened = drafted(pool, oracle, row(True), fields=True)
    assert opened.cand != off.cand and opened.contest.offered


def test_shadow_proposals_follow_the_gate(pool, first_item):
    """The router's shadow proposal of a row not running the drafter: where the gate is closed,
    the drafter's own (as with field drafts off); where it is open, the field draft."""
    oracle, row = first_item
    plans = [(("target",), 0)]
    seq = row(False)
    own = engine_drafts.shadow_proposals([seq], plans, {"ngram": oracle}, 16)["ngram"][0]
    assert own == oracle.script[len(seq.output_ids):][:len(own)] and own
    assert engine_drafts.shadow_proposals([seq], plans, {"ngram": oracle}, 16, fields=True)["ngram"][0] == own
    seq = row(True)
    field = engine_drafts.shadow_proposals([seq], plans, {"ngram": oracle}, 16, fields=True)["ngram"][0]
    g = seq.grammar
    assert field != own and field == certain_drafts.preferred(g, seq.output_ids, [], own, 16)
