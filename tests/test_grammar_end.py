"""How a constrained row ends (issue 30, item 5; engine/constrained.py step 1):

- the pool's EOS ends a constrained row even with ignore_eos;
- min_tokens with a grammar that allows only EOS: the EOS goes through (the processors never
  mask the only tokens left) and the row ends "stop", on every chain, jump forward on and off,
  equal to plain decoding; the negative control (min_tokens masking the EOS anyway) leaves
  every logit -inf;
- the last EOS, when it is the one token the complete grammar allows, is committed without a
  forward: a grammar that forces every token runs no cycle at all.
"""

import pytest
import torch
from fixtures import load_named_pool, repeating_prompts

from specrouter.config import SamplingParams
from specrouter.decoding import processors
from specrouter.decoding.grammar import GrammarSpec
from specrouter.engine.engine import Engine

CHAINS = [("target",), ("draft", "target"), ("ngram", "draft", "target")]
CHOICE = GrammarSpec("regex", "(yes|no|maybe)")
FORCED = GrammarSpec("regex", "The answer is 42\\.")


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return load_named_pool(tiny_pool_dirs, ("target", "draft"))


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts((6, 11))


def run(pool, prompts, params, chain, jump_forward=True):
    engine = Engine(pool)
    engine.jump_forward = jump_forward
    return engine.generate_ids(prompts, [params] * len(prompts), chain=chain, k=3)


def text(pool, seq):
    return pool.tokenizer.decode(seq.output_ids, skip_special_tokens=True)


def test_eos_ends_a_constrained_row_even_with_ignore_eos(pool, prompts):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, grammar=CHOICE)
    plain = run(pool, prompts, params, ("target",), jump_forward=False)
    for seq in plain:
        assert seq.finish_reason == "stop" and seq.output_ids[-1] in pool.eos_ids
        assert text(pool, seq) in ("yes", "no", "maybe")
    for chain in CHAINS[1:]:
        assert [s.output_ids for s in run(pool, prompts, params, chain)] == [s.output_ids for s in plain]
    unconstrained = run(pool, prompts, SamplingParams(max_new_tokens=30, ignore_eos=True), ("target",))
    assert all(s.finish_reason == "length" for s in unconstrained)  # ignore_eos does hold without it


@pytest.mark.parametrize("jump_forward", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_lets_eos_through_a_complete_grammar(pool, prompts, jump_forward, temperature):
    params = SamplingParams(max_new_tokens=30, min_tokens=20, temperature=temperature, seed=3,
                            grammar=CHOICE)
    outs = {}
    for chain in CHAINS:
        seqs = run(pool, prompts, params, chain, jump_forward)
        for seq in seqs:
            assert seq.finish_reason == "stop" and seq.output_ids[-1] in pool.eos_ids, chain
            assert text(pool, seq) in ("yes", "no", "maybe")
        outs[chain] = [s.output_ids for s in seqs]
    if temperature == 0.0:  # greedy: every chain equals plain decoding
        assert all(o == outs[("target",)] for o in outs.values())


@pytest.mark.parametrize("guard", [True, False])
def test_min_tokens_never_masks_the_only_tokens_left(pool, monkeypatch, guard):
    """The processors after "yes" (the grammar complete: only EOS allowed) with min_tokens
    unmet: the EOS stays finite, and so does nothing else. Negative control: without the
    guard every logit is -inf (the tiny tokenizer's EOS is id 0, which an argmax over an all
    -inf row picks by chance, so the engine tests above could not see it)."""
    from specrouter.decoding.grammar import RowGrammar

    if not guard:
        monkeypatch.setattr(processors, "never_empty", lambda masked, logits: masked)
    eos = frozenset(pool.eos_ids)
    params = SamplingParams(max_new_tokens=30, min_tokens=20, grammar=CHOICE)
    rg = RowGrammar(CHOICE, pool.tokenizer, tuple(pool.eos_ids), pool.vocab_width, eos)
    yes = pool.tokenizer.encode("yes", add_special_tokens=False)
    prompt = [5, 6, 7]
    h = processors.RowHistory(params, prompt + yes, len(prompt), eos, [], 0, rg)
    out = processors.process_row(torch.zeros(1, pool.vocab_width, dtype=torch.float64), h)  # (1, V)
    finite = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert finite == (sorted(eos) if guard else [])
    h = processors.RowHistory(params, prompt, len(prompt), eos, [], 0, rg)  # before "yes": EOS masked
    out = processors.process_row(torch.zeros(1, pool.vocab_width, dtype=torch.float64), h)
    assert not (set(torch.isfinite(out[0]).nonzero().flatten().tolist()) & eos)


def test_a_fully_forced_grammar_runs_no_cycle(pool, prompts):
    for chain in CHAINS:
        seqs = run(pool, prompts, SamplingParams(max_new_tokens=30, grammar=FORCED), chain)
        for seq in seqs:
            assert text(pool, seq) == "The answer is 42." and seq.finish_reason == "stop"
            assert seq.output_ids[-1] in pool.eos_ids and seq.stats.cycles == 0
    plain = run(pool, prompts, SamplingParams(max_new_tokens=30, grammar=FORCED), ("target",), jump_forward=False)
    assert [s.output_ids for s in plain] == [s.output_ids for s in seqs]
    assert all(s.stats.cycles > 0 for s in plain)
