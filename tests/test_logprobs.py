"""Log-probabilities (issue 31, item 2): the target's logprobs of the committed tokens and their
top alternatives, from the distribution each token was sampled from, read from the
verification logits (decoding/logprobs.py); the prompt's from its prefill (completions `echo`,
vLLM's `prompt_logprobs`).

1. Speculative decoding's logprobs equal plain decoding's bit for bit where the runner is
   row-invariant (float32, bfloat16: the same logits, the same function), for every chain, k,
   greedy and sampled with processors.
2. Plain decoding's logprobs equal a reference written here (transformers, full recompute, the
   controls applied by hand); a negative control (the raw distribution) does not.
3. Prompt logprobs equal the reference, the same after a prefix-cache hit and in chunks.
4. Through the server with the openai client: chat logprobs / top_logprobs and completions
   logprobs + echo equal the engine's plain decoding, streamed = whole.
"""

import math

import pytest
import torch
from fixtures import load_named_pool, repeating_prompts

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_mod
from specrouter.engine.engine import Engine

NAMES = ("target", "mid", "draft", "same")
CHAINS = [("same", "target"), ("draft", "target"), ("ngram", "draft", "mid", "target")]
MAX_NEW = 14
CASES = {
    "greedy": dict(logprobs=3),
    "greedy-processors": dict(logprobs=2, presence_penalty=1.0, frequency_penalty=0.4,
                              logit_bias=((7, 3.0),), min_tokens=4),
    "sampled": dict(logprobs=4, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.3, seed=7),
    "top-0": dict(logprobs=0, temperature=1.0, seed=3),
}


def run(pool, prompts, params, chain, k=4, engine=None):
    seqs = (engine or Engine(pool)).generate_ids(prompts, [params] * len(prompts), chain=chain, k=k)
    return [(s.output_ids, s.logprobs, s.prompt_logprobs) for s in seqs]


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts((6, 11, 17))


# -- 1. speculative = plain, bit for bit -----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_equal_plain_decoding_bit_for_bit(tiny_pool_dirs, prompts, dtype):
    pool = load_named_pool(tiny_pool_dirs, NAMES, dtype=dtype)
    for name, case in CASES.items():
        params = SamplingParams(max_new_tokens=MAX_NEW, **case)
        plain = run(pool, prompts, params, ("target",))
        for out, lps, _ in plain:
            assert len(lps) == len(out) and [e.token for e in lps] == out
            assert all(len(e.top) == case["logprobs"] for e in lps)
        for chain in CHAINS:
            for k in (2, 5):
                assert run(pool, prompts, params, chain, k) == plain, (name, chain, k)


def test_float64_logprobs_equal_plain_to_rounding(tiny_pool_dirs, prompts):
    """float64 runs through a path that is not row-invariant: the tokens are exact, the logprobs
    equal to rounding (1e-12)."""
    pool = load_named_pool(tiny_pool_dirs, NAMES)
    params = SamplingParams(max_new_tokens=MAX_NEW, **CASES["sampled"])
    plain = run(pool, prompts, params, ("target",))
    got = run(pool, prompts, params, ("ngram", "draft", "mid", "target"), 4)
    for (o1, l1, _), (o2, l2, _) in zip(got, plain):
        assert o1 == o2
        assert max(abs(a.logprob - b.logprob) for a, b in zip(l1, l2)) < 1e-12


# -- 2. the distribution each token was sampled from -----------------------------------------------
def reference_logprobs(path, prompt, out, params, stop_ids):
    """Per generated position: the reference processed log-distribution (V,), by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    ids, dists = list(prompt), []
    with torch.no_grad():
        for tok in out:
            x = model(torch.tensor([ids])).logits[0, -1].clone()
            gen = ids[len(prompt):]
            for t, b in params.logit_bias:
                x[t] += b
            if len(gen) < params.min_tokens:
                x[list(stop_ids)] = -math.inf
            for t in set(prompt) | set(gen):
                if params.repetition_penalty != 1.0:
                    x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
            for t in set(gen):
                x[t] -= params.frequency_penalty * gen.count(t) + params.presence_penalty
            if params.temperature > 0:
                x = x / params.temperature
                if params.top_k:
                    x[x < x.topk(params.top_k).values[-1]] = -math.inf
                if params.top_p < 1:
                    p = x.softmax(-1)
                    order = p.argsort(descending=True)
                    before = p[order].cumsum(0) - p[order]
                    x[order[before >= params.top_p]] = -math.inf
            dists.append(x.log_softmax(-1))
            ids.append(tok)
    return dists


@pytest.mark.parametrize("name", ["greedy", "greedy-processors", "sampled"])
def test_logprobs_are_the_processed_distribution(tiny_pool_dirs, prompts, name):
    pool = load_named_pool(tiny_pool_dirs, NAMES)
    params = SamplingParams(max_new_tokens=MAX_NEW, **CASES[name])
    seq = Engine(pool).generate_ids(prompts[1:2], [params], chain=("draft", "target"), k=3)[0]
    dists = reference_logprobs(tiny_pool_dirs["target"], prompts[1], seq.output_ids, params, seq.stop_ids)
    raw_differs = False
    for e, ref in zip(seq.logprobs, dists):
        assert e.logprob == pytest.approx(float(ref[e.token]), abs=1e-5)
        assert e.rank == 1 + int((ref > ref[e.token]).sum())
        top = ref.topk(len(e.top))
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=1e-5)
        if name == "greedy":
            assert e.rank == 1  # greedy: the argmax
    # negative control: the raw distribution (no processors, no temperature) is another one
    raw = reference_logprobs(tiny_pool_dirs["target"], prompts[1], seq.output_ids,
                             SamplingParams(max_new_tokens=MAX_NEW), seq.stop_ids)
    raw_differs = any(abs(e.logprob - float(r[e.token])) > 1e-6 for e, r in zip(seq.logprobs, raw))
    assert raw_differs == (name != "greedy")


# -- 3. prompt logprobs ----------------------------------------------------------------------------
def test_prompt_logprobs_reference_prefix_cache_and_chunks(tiny_pool_dirs, prompts, monkeypatch):
    from transformers import AutoModelForCausalLM

    pool = load_named_pool(tiny_pool_dirs, NAMES, dtype="float32")
    prompt = prompts[2]
    params = SamplingParams(max_new_tokens=4, prompt_logprobs=2)
    engine = Engine(pool)
    first = engine.generate_ids([prompt], [params], chain=("draft", "target"), k=3)[0]
    entries = first.prompt_logprobs
    assert [e.token for e in entries] == prompt[1:] and first.logprobs is None
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pool_dirs["target"]), dtype=torch.float64)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)  # (P-1, V)
    for e, r in zip(entries, ref):
        assert e.logprob == pytest.approx(float(r[e.token]), abs=1e-4)
        assert [t for t, _ in e.top] == r.topk(2).indices.tolist()
    # the same engine again: the prefix cache holds the prompt, the target recomputes it
    again = engine.generate_ids([prompt], [params], chain=("draft", "target"), k=3)[0]
    assert again.stats.cached_tokens > 0
    assert again.prompt_logprobs == entries and again.output_ids == first.output_ids
    # in chunks of 4 positions: the same values (to rounding; chunked attention)
    monkeypatch.setattr(executor_mod.ChainExecutor, "PROMPT_CHUNK", 4)
    chunked = Engine(pool).generate_ids([prompt], [params], chain=("target",))[0]
    assert [e.token for e in chunked.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in chunked.prompt_logprobs] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert chunked.output_ids == first.output_ids
