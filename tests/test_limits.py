"""Numbers at their edges: temperatures too small to divide by are greedy (never NaN), top_k is
bounded by the vocabulary, and the context holds prompt + max_new_tokens exactly, with the draft
length shrinking near the end instead of reserving positions (router on and off)."""

import logging

import pytest
import torch

from specrouter.config import GREEDY_TEMPERATURE, SamplingParams
from specrouter.decoding.sampling import SamplingTensors, process_logits
from specrouter.engine.engine import Engine
from specrouter.errors import ContextLengthError, SamplingParamsError
from specrouter.models.pool import Pool

NAMES = ("draft", "mid", "target")
LIMIT = 64


@pytest.fixture(scope="module")
def pool(tiny_pool_dirs):
    return Pool.load([tiny_pool_dirs[n] for n in NAMES], names=list(NAMES), target="target",
                     dtype="float64")


def greedy_ref(pool, prompt, n):
    return Engine(pool).generate_ids([prompt], [SamplingParams(max_new_tokens=n, ignore_eos=True)],
                                     chain=("target",))[0].output_ids


def prompt_of(n: int) -> list[int]:
    return [(7 * i + 3) % 300 + 1 for i in range(n)]


# -- sampling numerics ---------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy():
    for t in (1e-300, 5e-324, 1e-39, GREEDY_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.0 and p.greedy, t
    p = SamplingParams(temperature=GREEDY_TEMPERATURE)
    assert p.temperature == GREEDY_TEMPERATURE and not p.greedy


def test_threshold_temperature_gives_finite_probabilities():
    logits = torch.randn(3, 2, 320) * 1000  # (B, M, V), large logits at a tiny temperature
    st = SamplingTensors.from_params([SamplingParams(temperature=GREEDY_TEMPERATURE, top_p=0.9),
                                      SamplingParams(temperature=GREEDY_TEMPERATURE),
                                      SamplingParams(temperature=GREEDY_TEMPERATURE, top_k=5)])
    probs = process_logits(logits, st)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3, 2))
    assert (probs.argmax(-1) == logits.argmax(-1)).all()


@pytest.mark.parametrize("temperature", [1e-39, 1e-300])
@pytest.mark.parametrize("dtype", ["float64", "float32"])  # float32: logits / 1e-39 overflow
def test_tiny_temperature_decodes_greedily_for_any_seed(pool, tiny_pool_dirs, temperature, dtype):
    if dtype != "float64":
        pool = Pool.load([tiny_pool_dirs[n] for n in NAMES], names=list(NAMES), target="target",
                         dtype=dtype)
    prompt = [5, 6, 7, 8, 9, 10]
    ref = greedy_ref(pool, prompt, 16)
    for seed in range(5):
        eng = Engine(pool)
        (s,) = eng.generate_ids([prompt], [SamplingParams(temperature=temperature, seed=seed,
                                                          max_new_tokens=16, ignore_eos=True)],
                                chain=("draft", "target"), k=3,
                                generator=torch.Generator().manual_seed(seed))
        assert s.finish_reason == "length" and s.output_ids == ref, (temperature, seed)


def test_integer_bounds():
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=2**63)
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(seed=-(2**63) - 1)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(2**63,))


def test_top_k_is_bounded_by_the_vocabulary(pool):
    eng = Engine(pool)
    V = pool.vocab_width
    eng.check_request([1, 2], SamplingParams(temperature=1.0, top_k=V), ("target",), 4)
    with pytest.raises(SamplingParamsError, match=f"vocabulary size {V}"):
        eng.check_request([1, 2], SamplingParams(temperature=1.0, top_k=V + 1), ("target",), 4)


# -- context accounting ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(pool):
    from specrouter.router.setup import build_router

    return build_router(pool, progress=False)


@pytest.mark.parametrize("routed", [False, True], ids=["router-off", "router-on"])
def test_exact_context_boundaries(pool, router, routed):
    eng = Engine(pool, max_num_seqs=2, max_model_len=LIMIT, router=router if routed else None)
    chain = None if routed else ("ngram", "draft", "mid", "target")
    sp = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True)  # noqa: E731
    # the whole context: prompt + max_new_tokens == LIMIT, with the longest draft length
    for n_prompt in (LIMIT - 1, LIMIT - 2, LIMIT - 20, 5):
        n_new = LIMIT - n_prompt
        (s,) = eng.generate_ids([prompt_of(n_prompt)], [sp(n_new)], chain=chain, k=16)
        assert s.finish_reason == "length" and len(s.tokens) == LIMIT
        assert s.output_ids == greedy_ref(pool, prompt_of(n_prompt), n_new), n_prompt
    # one position more is refused, and the message states the real limits
    with pytest.raises(ContextLengthError, match="at most 1 tokens can be generated"):
        eng.check_request(prompt_of(LIMIT - 1), sp(2), chain, 16)
    with pytest.raises(ContextLengthError, match=f"at most {LIMIT - 1} prompt tokens"):
        eng.check_request(prompt_of(LIMIT), sp(1), chain, 16)
    assert eng.state.live() == []


def test_draft_shrinks_for_a_row_near_the_end_of_the_context(pool, tiny_pool_dirs, caplog):
    """A row 4 positions from the end batched with a row far from it: that row drafts at most
    what its caches can hold (not k=8 into positions past the context); the other keeps k=8."""
    fresh = Pool.load([tiny_pool_dirs[n] for n in NAMES], names=list(NAMES), target="target",
                      dtype="float64")  # caches of exactly LIMIT positions
    eng = Engine(fresh, max_num_seqs=2, max_model_len=LIMIT)
    assert {r.max_len for r in fresh.runners.values()} == {LIMIT}
    cycles = []
    eng.on_cycle = cycles.append
    near, far = prompt_of(LIMIT - 4), prompt_of(5)
    with caplog.at_level(logging.WARNING, logger="specrouter.engine.isolation"):
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True),
                                chain=("draft", "target"), k=8)
                for p, n in ((near, 4), (far, 40))]
        while eng.has_unfinished():
            eng.step()
    assert not caplog.records  # no cycle failed and was rerun row by row
    # k is per row: the row near the end drafts only what its caches can hold (3 tokens + the
    # bonus = the 4 positions left), the other row its full k=8, in the same step
    assert cycles[0].rows == 2 and [len(p) for p in cycles[0].row_proposal] == [3, 8]
    assert seqs[0].output_ids == greedy_ref(pool, near, 4)
    assert seqs[1].output_ids == greedy_ref(pool, far, 40)
