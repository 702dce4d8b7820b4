"""Lazy grammar masks for greedy rows (decoding/lazy_mask.py, `RowGrammar.refused`).

1. `refused` along a draft path returns exactly the positions whose token `allowed` masks (or
   a token llguidance's `validate_tokens` accepts but its mask does not: 'T' where the grammar
   forces "The "), with `allowed`'s masks there, up to the first position whose token differs
   from the path's candidate (nothing after it is read), and skips what `allowed` leaves
   unmasked.
2. The engine with lazy masks equals the engine with eager masks (every row processed), token
   for token, for several chains; the lazy path ran (fewer masks computed). Greedy equality to
   an independent reference is tests/test_grammar.py's (which runs the lazy path).
3. Negative controls: a `refused` that ignores the draft path, or that never masks, breaks the
   equality.
"""

import pytest
import torch
from fixtures import four_level_fixtures
from test_grammar import CHAINS, MAX_NEW, SPECS, fresh_allowed, row_grammar, walk

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_mod
from specrouter.decoding.grammar import RowGrammar
from specrouter.engine.engine import Engine

pool, prompts = four_level_fixtures()


def run(pool, prompts, params, chain, k=4):
    engine = Engine(pool)
    seqs = engine.generate_ids(prompts, [params] * len(prompts), chain=chain, k=k)
    return [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("name", ["json_schema", "lark", "regex"])
def test_refused_positions_are_the_masked_ones(pool, name):
    spec = SPECS[name]
    doc = walk(pool, spec, 14, seed=3)
    rg = row_grammar(pool, spec)
    g_ = torch.Generator().manual_seed(0)
    seen = 0
    for cut, offset, G in [(0, 0, 8), (3, 2, 4), (5, 0, 1), (2, 4, 1), (6, 1, 3)]:
        generated, path = doc[:cut], doc[cut:]
        masks = rg.allowed(generated, path, offset, G)  # (G, V)
        for trial in range(4):  # tokens: the path's own (accepted), random ones, stop tokens
            if trial == 0:
                tokens = (path[offset:] + [0] * G)[:G]
            elif trial == 3:
                tokens = [min(pool.eos_ids)] * G
            else:
                tokens = torch.randint(pool.vocab_width, (G,), generator=g_).tolist()
            # the walk ends at the first position whose token is not the path's candidate there
            last = next((g for g in range(G) if offset + g >= len(path) or tokens[g] != path[offset + g]), G - 1)
            got = list(rg.refused(generated, path, offset, list(tokens)))
            want = [g for g in range(last + 1) if not masks[g][tokens[g]]]
            assert [g for g, _ in got] == want, (name, cut, offset, trial)
            for g, mask in got:
                assert torch.equal(mask, masks[g])
            seen += len(got)
    assert seen > 0
    # a refused path token: the positions after it are unmasked (none refused)
    generated, path = doc[:2], list(doc[2:6])
    path[1] = next(t for t in range(pool.vocab_width)
                   if not fresh_allowed(pool, spec, generated + path[:1])[0][t] and t not in pool.eos_ids)
    tokens = [path[0]] + [path[1]] * 4  # refused at position 1: masked there; 2.. follow a refused path token
    assert [g for g, _ in rg.refused(generated, path, 0, tokens)] == [1]


def test_the_walk_ends_at_the_first_rejection(pool):
    """Past the first position whose token is not the path's candidate nothing is read: no mask
    is computed there, and a refused token there is not yielded (session 26)."""
    spec = SPECS["json_schema"]
    doc = walk(pool, spec, 14, seed=3)
    rg = row_grammar(pool, spec)
    generated, path = doc[:2], doc[2:10]
    bad = next(t for t in range(pool.vocab_width)
               if not fresh_allowed(pool, spec, generated + path[:3])[0][t] and t not in pool.eos_ids)
    tokens = path[:2] + [bad] * 6  # accepted twice, then refused tokens at every position
    before = rg.masks_computed
    got = list(rg.refused(generated, path, 0, list(tokens)))
    assert [g for g, _ in got] == [2]  # position 2 is the first rejection: 3.. are never read
    assert rg.masks_computed - before == 3
    # the caller's new token at a refused position decides: the path's candidate goes on
    row = path[:2] + [bad] * 6
    walked = []
    for g, _ in rg.refused(generated, path, 0, row):
        walked.append(g)
        row[g] = path[g] if g < 5 else row[g]  # the masked choice (here: the candidate) up to 4
    assert walked == [2, 3, 4, 5]


def test_a_token_the_check_accepts_but_the_mask_refuses_is_refused(pool):
    """Where the grammar forces text ("The "), llguidance's `validate_tokens` accepts a prefix
    token ('T') its mask refuses (only 'The' there): `refused` reads the mask."""
    rg = row_grammar(pool, SPECS["lark"])
    mask, m = fresh_allowed(pool, SPECS["lark"], [])
    odd = [t for t in range(pool.vocab_width) if m.validate_tokens([t]) == 1 and not mask[t]]
    assert odd  # (else this test shows nothing)
    got = list(rg.refused([], [], 0, odd[:1]))
    assert [g for g, _ in got] == [0] and torch.equal(got[0][1], mask)


def eager(monkeypatch):
    monkeypatch.setattr(executor_mod, "lazy", lambda w: False)


@pytest.mark.parametrize("name", ["json_schema", "lark"])
def test_lazy_masks_equal_eager_masks(pool, prompts, name, monkeypatch):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[name])
    calls, real = [], RowGrammar.refused

    def counted(self, *a):  # (passes each item through: the caller's new token decides the walk)
        n = 0
        for item in real(self, *a):
            n += 1
            yield item
        calls.append(n)

    with monkeypatch.context() as m:
        m.setattr(RowGrammar, "refused", counted)
        lazy_out = {chain: run(pool, prompts, params, chain)[0] for chain in [("target",)] + CHAINS[:3]}
    assert len(calls) > 0 and sum(calls) > 0  # the lazy path ran, and masked somewhere
    with monkeypatch.context() as m:
        eager(m)
        for chain, out in lazy_out.items():
            assert out == run(pool, prompts, params, chain)[0], chain


def test_negative_controls_a_wrong_refused_breaks_equality(pool, prompts, monkeypatch):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS["json_schema"])
    expected = {chain: run(pool, prompts, params, chain)[0] for chain in CHAINS[:2]}
    real = RowGrammar.refused

    def committed_only(self, generated, path, offset, tokens):  # every position masked at the committed state
        first = list(real(self, generated, [], 0, tokens[:1]))
        return [(g, first[0][1]) for g in range(len(tokens))] if first else []

    for wrong in (committed_only, lambda self, generated, path, offset, tokens: iter(())):
        with monkeypatch.context() as m:
            m.setattr(RowGrammar, "refused", wrong)
            broken = {chain: run(pool, prompts, params, chain)[0] for chain in CHAINS[:2]}
        assert broken != expected


OTHER_PROCESSORS = [dict(repetition_penalty=1.8), dict(presence_penalty=1.0), dict(frequency_penalty=1.0),
                    dict(logit_bias={5: 2.0}), dict(min_tokens=3), dict(allowed_token_ids=list(range(400))),
                    dict(logprobs=2)]


@pytest.mark.parametrize("extra", OTHER_PROCESSORS, ids=lambda d: next(iter(d)))
def test_a_row_with_another_processor_or_logprobs_is_masked_eagerly(extra):
    """Only a greedy row whose one processor is its grammar, asking no logprobs, is lazy: every
    other processor reads (or changes) the whole processed row (review25 D4)."""
    from types import SimpleNamespace

    from specrouter.decoding.lazy_mask import lazy

    def work(**kw):
        p = SamplingParams(max_new_tokens=4, grammar=SPECS["json_schema"], **kw)
        return SimpleNamespace(processors=True, seq=SimpleNamespace(params=p, grammar=object()))

    assert lazy(work())  # (else this test shows nothing)
    assert not lazy(work(**extra))
    assert not lazy(work(temperature=0.7, seed=1))  # sampled: the whole masked distribution


def test_a_penalty_beside_a_grammar_keeps_its_effect(pool, prompts, monkeypatch):
    """A greedy constrained row with a repetition penalty: the shipped path equals eager masks
    (every row processed). Negative control: a `lazy` that ignores the penalty (the row's
    processors skipped where its grammar allows the raw argmax) changes the output."""
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS["json_schema"], repetition_penalty=1.8)
    chain = CHAINS[0]
    shipped = run(pool, prompts, params, chain)[0]
    with monkeypatch.context() as m:
        eager(m)
        assert shipped == run(pool, prompts, params, chain)[0]
    with monkeypatch.context() as m:
        m.setattr(executor_mod, "lazy", lambda w: bool(w.processors and w.seq.params.greedy
                                                        and w.seq.grammar is not None))
        assert run(pool, prompts, params, chain)[0] != shipped
