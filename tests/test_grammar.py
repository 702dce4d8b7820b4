"""Grammar-constrained decoding (issue 30, items 1, 2 and 4): the grammar's token mask applied
at every level of the chain (decoding/grammar.py, engine/constrained.py).

1. `RowGrammar.allowed` along a draft path equals fresh matchers fed each position's history
   (written here); a refused path token leaves the later positions unmasked; the matcher
   follows a row rolled back; `forced_tokens` are exactly the positions with one allowed token.
2. Greedy: output with a JSON schema, a Lark grammar and a regex equals a reference plain
   constrained decoding written here (transformers, float64, the whole sequence recomputed,
   a fresh llguidance mask each step), token for token, for chains of depth 2-4, several k,
   jump-forward on and off; every finished output validates.
3. float32 and bfloat16 (native kernels): every chain equals the engine's plain decoding.
4. Seeded sampling: speculative == plain with the same seed; no sampled token is ever masked.
5. Negative controls: masks computed from the committed tokens only (the draft path left out)
   break the equality; the grammar changes the output (else these tests could not see it).
6. Errors: a bad schema names the problem before any row runs; a row whose grammar reaches a
   dead end finishes with finish_reason "grammar".
"""

import json

import llguidance
import llguidance.hf
import llguidance.torch as lt
import pytest
import torch
from fixtures import FOUR_LEVELS, four_level_fixtures, load_named_pool

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_mod
from specrouter.decoding import grammar as grammar_mod
from specrouter.decoding.grammar import GrammarError, GrammarSpec, RowGrammar, unpack_bitmask
from specrouter.engine import constrained
from specrouter.engine.engine import Engine

NAMES = FOUR_LEVELS
MAX_NEW = 40
CHAINS = [("same", "target"), ("draft", "target"), ("ngram", "target"), ("draft", "mid", "target"),
          ("ngram", "draft", "mid", "target")]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["point", "line", "polygon"]},
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "n", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": GrammarSpec.json_schema(SCHEMA),
    "json_object": GrammarSpec("json_object"),
    "lark": GrammarSpec("lark", 'start: "The " ("fox" | "dog") " is " NUM "."\nNUM: /[0-9]{1,3}/'),
    "regex": GrammarSpec("regex", r"(def|class) [a-z_]{1,8}\(\)"),
}


pool, prompts = four_level_fixtures()


def fresh_allowed(pool, spec, tokens):
    """(V,) bool: a fresh matcher fed `tokens`, its mask (the reference)."""
    tok = grammar_mod._ll_tokenizer(pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width)
    m = llguidance.LLMatcher(tok, grammar_mod.to_llguidance(spec), log_level=0)
    assert m.consume_tokens(list(tokens)), m.get_error()
    bits = lt.allocate_token_bitmask(1, tok.vocab_size)
    lt.fill_next_token_bitmask(m, bits, 0)
    return unpack_bitmask(bits, pool.vocab_width)[0], m


def row_grammar(pool, spec):
    return RowGrammar(spec, pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width, frozenset(pool.eos_ids))


def walk(pool, spec, n, seed=0):
    """n tokens the grammar allows, chosen at random among the allowed ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        allowed, m = fresh_allowed(pool, spec, out)
        ids = [t for t in allowed.nonzero().flatten().tolist() if t not in pool.eos_ids]
        if not ids or m.is_stopped():
            break
        out.append(ids[int(torch.randint(len(ids), (1,), generator=g))])
    return out


# -- 1. the mask along a draft path ---------------------------------------------------------
@pytest.mark.parametrize("name", list(SPECS))
def test_masks_along_the_path_equal_fresh_matchers(pool, name):
    spec = SPECS[name]
    doc = walk(pool, spec, 14, seed=3)
    assert len(doc) >= 8
    rg = row_grammar(pool, spec)
    for cut, offset, G in [(0, 0, 8), (3, 2, 4), (5, 0, 1), (2, 4, 1), (6, 1, 3)]:
        generated, path = doc[:cut], doc[cut:]
        got = rg.allowed(generated, path, offset, G)  # (G, V)
        for g in range(G):
            ref, _ = fresh_allowed(pool, spec, generated + path[: offset + g])
            assert torch.equal(got[g], ref), (name, cut, offset, g)
    # a refused path token: the positions after it are unmasked, the ones before it exact
    generated, path = doc[:2], list(doc[2:6])
    bad = next(t for t in range(pool.vocab_width) if not fresh_allowed(pool, spec, generated + path[:2])[0][t])
    path[2] = bad
    got = rg.allowed(generated, path, 0, 5)
    assert torch.equal(got[2], fresh_allowed(pool, spec, generated + path[:2])[0])
    assert got[3].all() and got[4].all()
    assert rg.valid_prefix(generated, path) == 2
    # ... also before the positions asked (offset past it: a draft token at a position whose
    # masked logits were all -inf) it leaves the matcher usable: the masks after it are exact
    path[2] = next(t for t in range(pool.vocab_width)
                   if not fresh_allowed(pool, spec, generated + path[:2])[0][t] and t not in pool.eos_ids)
    got = rg.allowed(generated, path, 3, 2)
    assert got.all()
    assert not rg.dead_end
    assert torch.equal(rg.allowed(generated, path[:2], 2, 1)[0], fresh_allowed(pool, spec, generated + path[:2])[0])
    # the matcher follows a row rolled back and re-extended differently
    rg.sync(doc[:10])
    rg.sync(doc[:4])
    assert torch.equal(rg.allowed(doc[:4], [], 0, 1)[0], fresh_allowed(pool, spec, doc[:4])[0])
    assert rg.consumed == doc[:4]


@pytest.mark.parametrize("name", ["json_schema", "lark"])
def test_forced_tokens_are_exactly_the_single_choice_positions(pool, name):
    spec = SPECS[name]
    doc = walk(pool, spec, 30, seed=1)
    rg = row_grammar(pool, spec)
    seen_forced = 0
    for cut in range(len(doc)):
        forced = rg.forced_tokens(doc[:cut], 50)
        hist = doc[:cut]
        for t in forced:  # each forced token is the only allowed one there
            allowed, _ = fresh_allowed(pool, spec, hist)
            assert allowed.nonzero().flatten().tolist() == [t]
            hist = hist + [t]
        allowed, m = fresh_allowed(pool, spec, hist)  # and the run stops where a choice starts
        assert m.is_stopped() or int(allowed.sum()) != 1 or set(allowed.nonzero().flatten().tolist()) & set(pool.eos_ids)
        seen_forced += len(forced)
    assert seen_forced > 0  # the test saw forced tokens


# -- 2. greedy: equal to a reference plain constrained decoding -------------------------------
def reference_greedy(path, pool, spec, prompt, max_new):
    """Plain transformers greedy decoding, float64, masked by a fresh matcher's mask each step;
    it ends at EOS (the only token a complete grammar allows) or at max_new."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    out = []
    with torch.no_grad():
        while len(out) < max_new:
            allowed, _ = fresh_allowed(pool, spec, out)
            logits = model(torch.tensor([prompt + out])).logits[0, -1, : pool.vocab_width]
            out.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
            if out[-1] in pool.eos_ids:
                break
    return out


def run(pool, prompts, params, chain, k=4, jump_forward=True):
    engine = Engine(pool)
    engine.jump_forward = jump_forward
    seqs = engine.generate_ids(prompts, [params] * len(prompts), chain=chain, k=k)
    return [s.output_ids for s in seqs], seqs


@pytest.fixture(scope="module")
def references(pool, tiny_pool_dirs, prompts):
    return {name: [reference_greedy(tiny_pool_dirs["target"], pool, spec, p, MAX_NEW) for p in prompts]
            for name, spec in SPECS.items()}


def check_valid(pool, name, out, seq):
    text = pool.tokenizer.decode(out, skip_special_tokens=True)
    if seq.finish_reason != "stop":
        return
    if name in ("json_schema", "json_object"):
        doc = json.loads(text)
        assert isinstance(doc, dict)
        if name == "json_schema":
            assert set(doc) == set(SCHEMA["required"]) and doc["kind"] in ("point", "line", "polygon")
    elif name == "lark":
        assert text.startswith("The ") and text.endswith(".")


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_equals_reference_plain_decoding(pool, prompts, references, name):
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[name])
    expected = references[name]
    plain, seqs = run(pool, prompts, params, ("target",), jump_forward=False)
    assert plain == expected
    for out, seq in zip(plain, seqs):
        check_valid(pool, name, out, seq)
    free, _ = run(pool, prompts, SamplingParams(max_new_tokens=MAX_NEW), ("target",))
    assert free != plain  # the grammar changes the output
    for jf in (True, False):
        got, _ = run(pool, prompts, params, ("target",), jump_forward=jf)
        assert got == expected, jf
        for chain in CHAINS:
            for k in (2, 5):
                got, _ = run(pool, prompts, params, chain, k, jump_forward=jf)
                assert got == expected, (chain, k, jf)


def test_an_exact_draft_is_accepted_under_the_grammar(pool, prompts):
    """The "same" draft (the target's copy) proposes what the target samples only if both see the
    same mask at every drafted position: misaligned masks would show as rejections."""
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS["json_schema"])
    _, seqs = run(pool, prompts, params, ("same", "target"), 4, jump_forward=False)
    for seq in seqs:
        assert seq.stats.acceptance_rates["same>target"] > 0.99, seq.stats.acceptance_rates


def test_finished_outputs_validate_against_the_schema(pool, prompts, references):
    params = SamplingParams(max_new_tokens=120, grammar=SPECS["json_schema"])
    outs, seqs = run(pool, prompts, params, ("draft", "target"), 4)
    assert any(s.finish_reason == "stop" for s in seqs)
    for out, seq in zip(outs, seqs):
        check_valid(pool, "json_schema", out, seq)


# -- 3. float32 and bfloat16 ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_every_chain_equals_plain(tiny_pool_dirs, prompts, dtype):
    pool = load_named_pool(tiny_pool_dirs, NAMES, dtype=dtype, backend="native")
    for name in ("json_schema", "lark"):
        params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS[name])
        plain, _ = run(pool, prompts, params, ("target",), jump_forward=False)
        for chain in CHAINS:
            got, _ = run(pool, prompts, params, chain, 4)
            assert got == plain, (dtype, name, chain)


# -- 4. seeded sampling ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["json_schema", "regex"])
def test_seeded_sampling_equals_plain_and_stays_in_the_grammar(pool, prompts, name):
    spec = SPECS[name]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7, grammar=spec)
    plain, seqs = run(pool, prompts, params, ("target",), jump_forward=False)
    for out in plain:  # every sampled token was allowed where it was sampled
        for i, t in enumerate(out):
            if t in pool.eos_ids:
                break
            assert fresh_allowed(pool, spec, out[:i])[0][t]
    for chain in CHAINS:
        got, _ = run(pool, prompts, params, chain, 4)
        assert got == plain, chain
    other, _ = run(pool, prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=8, grammar=spec),
                   ("target",))
    assert other != plain  # the seed matters


# -- 5. negative control ----------------------------------------------------------------------
def test_negative_control_masks_without_the_draft_path_break_equality(pool, prompts, references, monkeypatch):
    real = RowGrammar.allowed

    def committed_only(self, generated, path, offset, G):
        return real(self, generated, [], 0, 1).expand(G, -1)  # every position: the committed state

    monkeypatch.setattr(RowGrammar, "allowed", committed_only)
    monkeypatch.setattr(executor_mod, "lazy", lambda w: False)  # eager masks (test_lazy_mask.py has the lazy ones' control)
    params = SamplingParams(max_new_tokens=MAX_NEW, grammar=SPECS["json_schema"])
    broken = [run(pool, prompts, params, chain, 4, jump_forward=False)[0] for chain in CHAINS[:2]]
    assert any(b != references["json_schema"] for b in broken)


# -- 6. errors --------------------------------------------------------------------------------
def test_bad_schema_is_refused_before_any_row_runs(pool, prompts):
    engine = Engine(pool)
    bad = SamplingParams(max_new_tokens=8, grammar=GrammarSpec.json_schema({"type": "objekt"}))
    with pytest.raises(GrammarError, match="objekt"):
        engine.generate_ids(prompts[:1], [bad], chain=("target",))
    ref = SamplingParams(max_new_tokens=8, grammar=GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    with pytest.raises(GrammarError, match="nowhere"):
        engine.generate_ids(prompts[:1], [ref], chain=("target",))
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{not json")
    with pytest.raises(GrammarError):
        engine.generate_ids(prompts[:1], [SamplingParams(grammar=GrammarSpec("lark", "start: ("))],
                            chain=("target",))
    assert not engine.running


def test_dead_end_finishes_the_row_with_finish_reason_grammar(pool, prompts):
    engine = Engine(pool)
    engine.reserve(2, 64)
    spec = SPECS["lark"]
    seq = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8, grammar=spec), chain=("target",))
    other = engine.add_request(prompts[1], SamplingParams(max_new_tokens=8), chain=("target",))
    bad = next(t for t in range(pool.vocab_width)
               if not fresh_allowed(pool, spec, [])[0][t] and t not in pool.eos_ids)
    seq.tokens.append(bad)  # a token the grammar refuses got committed: nothing can follow it
    outs = engine.step()
    assert seq.done and seq.finish_reason == constrained.DEAD_END and "grammar" in seq.error
    assert not other.done and any(o.seq is other and o.new_token_ids for o in outs)


# -- the Python API and the CLI ---------------------------------------------------------------
def test_api_json_schema_grammar_and_pydantic_model(tiny_pool_dirs, pool):
    from pydantic import BaseModel

    from specrouter import SpecRouter

    class Shape(BaseModel):
        name: str
        n: int

    sr = SpecRouter(pool)
    kw = dict(max_new_tokens=60, chain=("draft", "target"), k=3)
    by_dict = sr.generate("def add(a, b):", json_schema=Shape.model_json_schema(), **kw)[0]
    by_model = sr.generate("def add(a, b):", json_schema=Shape, **kw)[0]
    by_text = sr.generate("def add(a, b):", json_schema=json.dumps(Shape.model_json_schema()), **kw)[0]
    assert by_dict.token_ids == by_model.token_ids == by_text.token_ids
    plain = sr.generate("def add(a, b):", json_schema=Shape, max_new_tokens=60, chain=("target",))[0]
    assert plain.token_ids == by_dict.token_ids
    if by_dict.finish_reason == "stop":
        Shape.model_validate_json(by_dict.text)
    lark = sr.generate("x", grammar=SPECS["lark"].source, max_new_tokens=20, chain=("ngram", "target"))[0]
    assert lark.text.startswith("The ")
    streamed = list(sr.stream("def add(a, b):", json_schema=Shape, **kw))
    assert [t for c in streamed for t in c.token_ids] == by_dict.token_ids
    with pytest.raises(GrammarError, match="not both"):
        sr.generate("x", json_schema=Shape, grammar="start: \"a\"")


def test_cli_json_schema_file(tiny_pool_dirs, monkeypatch, tmp_path, capsys):
    import os

    from specrouter.cli.main import main

    d = tiny_pool_dirs
    monkeypatch.setenv("SPECROUTER_DEFAULT_POOL", os.pathsep.join(["ngram", str(d["draft"]), str(d["target"])]))
    bounded = {"type": "object", "properties": {"kind": SCHEMA["properties"]["kind"], "ok": {"type": "boolean"}},
               "required": ["kind", "ok"], "additionalProperties": False}
    schema = tmp_path / "shape.json"
    schema.write_text(json.dumps(bounded))
    assert main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "40", "--dtype", "float64",
                 "--static", "--json-schema", str(schema)]) == 0
    out = capsys.readouterr().out.strip()
    assert list(json.loads(out)) == ["kind", "ok"]  # valid, properties in the schema's order
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["generate", "--prompt", "x", "--json-schema", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
