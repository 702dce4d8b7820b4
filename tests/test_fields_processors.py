"""Sampling controls as logits processors applied identically at every level of the chain
(issue 31, part b): min_p, presence / frequency / repetition penalties, logit_bias,
allowed_token_ids, stop_token_ids, min_tokens.

1. The pure functions equal a naive reference written here (loops over tokens, the APIs'
   definitions), including the draft path's tokens before each position.
2. Greedy: speculative output with every control equals a reference plain decoding written
   here (transformers, the full sequence recomputed each step, the naive processors), token for
   token, for chains of depth 2-4 and several k; each control changes the output (so the test
   can see it).
3. Seeded sampling: speculative output equals the engine's plain decoding with the same seed
   and controls.
4. Negative controls: penalties computed from the committed tokens only (the draft path left
   out) at every level break the equality; processors applied at the target only keep it (the
   target's own token decides: verification compares tokens) but drafts lose acceptance.
"""

import math

import pytest
import torch
from fixtures import FOUR_LEVELS, four_level_fixtures, load_named_pool

from specrouter.config import SamplingParams
from specrouter.decoding import executor as executor_mod
from specrouter.decoding.processors import RowHistory, process_rows
from specrouter.decoding.sampling import SamplingTensors, process_logits, scaled_logits
from specrouter.engine.engine import Engine

NAMES = FOUR_LEVELS
MAX_NEW = 16
# "same" (an exact copy of the target) accepts whole drafts: every position of the path is
# committed, so a wrong history anywhere along it shows in the output
CHAINS = [("same", "target"), ("draft", "target"), ("ngram", "target"), ("draft", "mid", "target"),
          ("ngram", "draft", "mid", "target")]
NAMES_OF_CONTROLS = ["presence", "frequency", "repetition", "penalties-negative", "logit_bias",
                     "allowed", "min_tokens", "stop_token_ids", "all"]


def make_controls(common: list[int]) -> dict[str, dict]:
    """Each control, built on tokens the unconstrained greedy output uses (`common`, most
    frequent first) so that it changes the output."""
    a, b, c = common[:3]
    return {
        "presence": dict(presence_penalty=1.5),
        "frequency": dict(frequency_penalty=0.8),
        "repetition": dict(repetition_penalty=1.8),
        "penalties-negative": dict(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.7),
        "logit_bias": dict(logit_bias=((a, -100.0), (7, 4.0), (b, -5.0))),
        "allowed": dict(allowed_token_ids=tuple(t for t in range(3, 300) if t not in (a, c))),
        "min_tokens": dict(min_tokens=MAX_NEW - 2, stop_token_ids=(a, b)),
        "stop_token_ids": dict(stop_token_ids=(a, b)),
        "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                    logit_bias=((7, 2.0), (c, -3.0)), min_tokens=4, stop_token_ids=(b,)),
    }


UNIT_CONTROLS = make_controls([5, 17, 42])


# -- 1. the naive reference ------------------------------------------------------------------
def naive_process(logits, params, prompt, generated, stop_ids):
    """One position: raw logits (V,) after `prompt` + `generated` -> processed logits (V,),
    token by token as vLLM / OpenAI define each control."""
    x = [float(v) for v in logits]
    V = len(x)
    if params.allowed_token_ids is not None:
        x = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for t, b in params.logit_bias:
        x[t] += b
    if len(generated) < params.min_tokens:
        for t in stop_ids:
            if t < V:
                x[t] = -math.inf
    seen = set(prompt) | set(generated)
    for t in range(V):
        if params.repetition_penalty != 1.0 and t in seen:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        c = generated.count(t)
        x[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("name", NAMES_OF_CONTROLS)
def test_processors_equal_naive_reference_along_the_draft_path(name):
    g = torch.Generator().manual_seed(0)
    V = 64
    control = {k: v for k, v in UNIT_CONTROLS[name].items() if k not in ("allowed_token_ids", "min_tokens")}
    if "allowed_token_ids" in UNIT_CONTROLS[name]:
        control["allowed_token_ids"] = tuple(range(3, 40))
    if "min_tokens" in UNIT_CONTROLS[name]:
        control["min_tokens"] = 6
    params = SamplingParams(max_new_tokens=32, **control)
    prompt = torch.randint(0, V, (9,), generator=g).tolist()
    out = torch.randint(0, V, (3,), generator=g).tolist()
    path = torch.randint(0, V, (5,), generator=g).tolist()
    stops = frozenset({5, 17, 42, 2})
    for offset, G in [(0, 6), (2, 1), (5, 1), (1, 3)]:
        logits = torch.randn(1, G, V, generator=g, dtype=torch.float64) * 3
        got = process_rows(logits, [RowHistory(params, prompt + out, len(prompt), stops, path, offset)])
        for pos in range(G):
            ref = naive_process(logits[0, pos], params, prompt, out + path[: offset + pos], stops)
            assert torch.equal(got[0, pos].isinf(), ref.isinf())
            fin = ~ref.isinf()
            assert torch.allclose(got[0, pos][fin], ref[fin], rtol=0, atol=1e-12), (name, offset, pos)


def test_min_p_keeps_tokens_above_min_p_times_the_top():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 50, generator=g, dtype=torch.float64) * 2
    params = [SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, min_p=0.5, top_k=10)]
    st = SamplingTensors.from_params(params)
    probs = process_logits(logits, st)
    for b, p in enumerate(params):
        full = (logits[b] / p.temperature).softmax(-1)  # (2, V)
        kept = full >= p.min_p * full.amax(-1, keepdim=True)
        if p.top_k:
            kept &= full >= full.topk(p.top_k, -1).values[:, -1:]
        assert torch.equal(probs[b] > 0, kept)
        assert torch.allclose(probs[b], torch.where(kept, full, 0) / torch.where(kept, full, 0).sum(-1, keepdim=True))
    # scaled_logits (what the coupled sampler uses) filters the same tokens
    assert torch.equal(scaled_logits(logits, st).isfinite(), probs > 0)


# -- 2. greedy: equal to a reference plain decoding --------------------------------------------
pool, prompts = four_level_fixtures()


@pytest.fixture(scope="module")
def controls(pool, prompts):
    out, _ = run(pool, prompts, SamplingParams(max_new_tokens=MAX_NEW), ("target",))
    counts = {}
    for o in out:
        for t in o[:6]:
            counts[t] = counts.get(t, 0) + 1
    common = sorted(counts, key=lambda t: (-counts[t], t))
    return make_controls((common + [5, 17, 42])[:3])


def reference_greedy(path, prompt, params, stop_ids, max_new):
    """Plain transformers greedy decoding with the naive processors (full recompute per step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            x = naive_process(logits, params, prompt, ids[len(prompt):], stop_ids)
            ids.append(int(x.argmax()))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


def run(pool, prompts, params, chain, k=4, generator=None):
    seqs = Engine(pool).generate_ids(prompts, [params] * len(prompts), chain=chain, k=k,
                                     generator=generator)
    return [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("name", NAMES_OF_CONTROLS)
def test_greedy_with_control_equals_reference_plain_decoding(pool, tiny_pool_dirs, prompts, controls, name):
    params = SamplingParams(max_new_tokens=MAX_NEW, **controls[name])
    plain, seqs = run(pool, prompts, params, ("target",))
    stop_ids = seqs[0].stop_ids
    expected = [reference_greedy(tiny_pool_dirs["target"], p, params, stop_ids, MAX_NEW) for p in prompts]
    assert plain == expected
    # the control changes the output (else this test could not see it)
    without, _ = run(pool, prompts, SamplingParams(max_new_tokens=MAX_NEW), ("target",))
    assert without != plain
    for chain in CHAINS:
        for k in (2, 5):
            got, _ = run(pool, prompts, params, chain, k)
            assert got == expected, (chain, k)


# -- 3. seeded sampling: equal to plain decoding with the same seed -----------------------------
@pytest.mark.parametrize("name", ["all", "repetition", "logit_bias", "min_tokens", "allowed"])
def test_seeded_sampling_with_control_equals_plain(pool, prompts, controls, name):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, min_p=0.02,
                            seed=1234, **controls[name])
    plain, _ = run(pool, prompts, params, ("target",))
    for chain in CHAINS:
        got, _ = run(pool, prompts, params, chain, 4)
        assert got == plain, chain
    unseeded_other = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=99,
                                    **controls[name])
    assert run(pool, prompts, unseeded_other, ("target",))[0] != plain  # the seed matters


def test_min_p_sampling_equals_plain(pool, prompts):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.5, min_p=0.2, seed=5)
    plain, _ = run(pool, prompts, params, ("target",))
    loose, _ = run(pool, prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.5, seed=5), ("target",))
    assert loose != plain
    for chain in CHAINS:
        assert run(pool, prompts, params, chain, 3)[0] == plain


# -- 4. negative controls ------------------------------------------------------------------------
def test_penalties_without_the_draft_path_break_equality(pool, prompts, monkeypatch):
    """A broken executor whose processors see only the committed tokens (not the candidates
    before each position) must NOT reproduce plain decoding: the test above can fail."""
    params = SamplingParams(max_new_tokens=MAX_NEW, presence_penalty=2.0, frequency_penalty=1.0,
                            repetition_penalty=1.8)
    plain, _ = run(pool, prompts, params, ("target",))
    real = executor_mod.RowHistory

    def stale(p, tokens, prompt_len, stop_ids, path, offset, *rest):
        return real(p, tokens, prompt_len, stop_ids, [], 0, *rest)

    monkeypatch.setattr(executor_mod, "RowHistory", stale)
    runs = [run(pool, prompts, params, chain, 5) for chain in CHAINS]
    assert all(s.finish_reason != "error" for _, seqs in runs for s in seqs)  # wrong, not failed
    assert any(out != plain for out, _ in runs)


def test_processors_at_the_target_only_stay_exact_but_lose_acceptance(pool, prompts, monkeypatch):
    """Verification compares each level's own sampled token, so the target's processors alone
    decide the output (it stays exact); drafts that do not see the controls propose what the
    target then rejects: acceptance drops. Processing at every level is what keeps it."""
    params = SamplingParams(max_new_tokens=MAX_NEW, presence_penalty=2.0, frequency_penalty=1.0,
                            repetition_penalty=1.8)
    plain, _ = run(pool, prompts, params, ("target",))
    got_all, seqs_all = run(pool, prompts, params, ("same", "target"), 4)
    assert got_all == plain
    # an exact copy of the target that sees the same history at each draft step accepts all
    for s in seqs_all:
        assert s.stats.accepted["same>target"] == s.stats.drafted["same>target"] > 0
    real = executor_mod.process_rows
    current = [None]
    orig_run_model = executor_mod.ChainExecutor._run_model

    def run_model(self, name, work, sampling):
        current[0] = name
        return orig_run_model(self, name, work, sampling)

    def target_only(logits, rows, **kw):
        if current[0] != "target":
            return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        return real(logits, rows, **kw)

    monkeypatch.setattr(executor_mod, "process_rows", target_only)
    monkeypatch.setattr(executor_mod.ChainExecutor, "_run_model", run_model)
    got_target_only, seqs_t = run(pool, prompts, params, ("same", "target"), 4)
    assert got_target_only == plain
    # more cycles for the same tokens: fewer drafted tokens accepted
    assert sum(s.stats.cycles for s in seqs_t) > sum(s.stats.cycles for s in seqs_all)
