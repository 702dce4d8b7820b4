"""Greedy equivalence: whatever the chain and draft length, the output equals target-only
greedy decoding token for token (float64 tiny models make this exact)."""

import pytest
import torch
from fixtures import TINY_POOL, named_router, repeating_prompts

from specrouter import SpecRouter

PROMPT_LENS = (3, 7, 12, 20)
MAX_NEW = 20


@pytest.fixture(scope="module")
def router(tiny_pool_dirs):
    # a small "same" draft must look cheaper than the target: parameter counts tie, so the
    # target is named explicitly (named_router does)
    return named_router(tiny_pool_dirs, TINY_POOL)


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts(PROMPT_LENS)


def reference_greedy(path, prompt, max_new):
    """Plain transformers greedy decoding, recomputing the full sequence each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(tiny_pool_dirs, prompts):
    return [reference_greedy(tiny_pool_dirs["target"], p, MAX_NEW) for p in prompts]


CHAINS = [
    ("target",),
    ("draft", "target"),
    ("ngram", "target"),
    ("same", "target"),
    ("random", "target"),
    ("draft", "mid", "target"),
    ("ngram", "draft", "target"),
    ("ngram", "random", "mid", "target"),
]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: ">".join(c))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_chain_output_equals_target_greedy(router, prompts, expected, chain, k):
    results = router.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=chain, k=k)
    for res, exp in zip(results, expected):
        assert res.token_ids == exp
        assert res.finish_reason == "length"
        assert res.stats.generated == MAX_NEW


def test_same_draft_accepts_everything_random_draft_almost_nothing(router, prompts):
    same = router.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("same", "target"), k=4)
    rand = router.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=("random", "target"), k=4)
    for r in same:
        assert r.stats.acceptance_rates["same>target"] == 1.0
        assert r.stats.mean_acceptance_length > 4.0  # 5 per full cycle, the last cycle is capped
    total_d = sum(r.stats.drafted["random>target"] for r in rand)
    total_a = sum(r.stats.accepted["random>target"] for r in rand)
    assert total_a / total_d < 0.2


def test_stop_tokens_end_rows_independently(router, prompts, expected):
    # stop each row at the token it generates 5th (under target greedy): rows end at different
    # cycles, the batch continues with the others
    for chain in [("target",), ("draft", "mid", "target")]:
        for p, exp in zip(prompts, expected):
            stop = exp[4]
            first = exp.index(stop)
            res = router.generate([p], max_new_tokens=MAX_NEW, chain=chain, k=3,
                                  stop_token_ids=(stop,), ignore_eos=True)[0]
            # ignore_eos only concerns EOS; request stop tokens still stop
            assert res.token_ids == exp[: first + 1]
            assert res.finish_reason == "stop"


def test_transformers_fallback_backend_is_equivalent(tiny_pool_dirs, prompts, expected):
    """The same pool through the generic transformers runner (any architecture) is exact too."""
    d = tiny_pool_dirs
    sr = SpecRouter.from_pretrained([d["draft"], d["mid"], d["target"]], target="target",
                                    names=["draft", "mid", "target"], dtype="float64", backend="hf")
    for chain, k in [(("target",), 1), (("draft", "target"), 3), (("ngram", "draft", "mid", "target"), 2)]:
        results = sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, chain=chain, k=k)
        assert [r.token_ids for r in results] == expected


def test_draft_with_a_vocabulary_subset_stays_exact(tiny_pool_dirs, prompts, expected, tmp_path):
    """A draft that proposes only part of the vocabulary (draft_vocab.json): its logits are
    -inf elsewhere, the chain's output is still the target's."""
    import json
    import shutil

    from specrouter.models.runners.base import ForwardBatch
    from specrouter.models.runners.llama import DRAFT_VOCAB_FILE, load_llama_runner

    sub = tmp_path / "same-sub"
    shutil.copytree(tiny_pool_dirs["same"], sub)
    keep = sorted(set(range(0, 320, 2)) | {1})  # half the vocabulary
    (sub / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": keep}))
    full = load_llama_runner(tiny_pool_dirs["same"], dtype=torch.float64, max_len=64)
    part = load_llama_runner(sub, dtype=torch.float64, max_len=64)
    batch = ForwardBatch.build([0], [0], [prompts[2]], [list(range(len(prompts[2])))])
    a, b = full.forward(batch), part.forward(batch)  # (1, T, V)
    mask = torch.zeros(a.shape[-1], dtype=torch.bool)
    mask[keep] = True
    torch.testing.assert_close(b[..., mask], a[..., mask], rtol=1e-12, atol=1e-12)
    assert bool(torch.isneginf(b[..., ~mask]).all())

    sr = SpecRouter.from_pretrained([sub, tiny_pool_dirs["target"]], target="target",
                                    names=["same-sub", "target"], dtype="float64", adaptive=False)
    outs = sr.generate(prompts, max_new_tokens=MAX_NEW, chain=["same-sub", "target"], k=4)
    assert [o.token_ids for o in outs] == expected
    accepted = sum(o.stats.accepted.get("same-sub>target", 0) for o in outs)
    drafted = sum(o.stats.drafted.get("same-sub>target", 0) for o in outs)
    assert 0 < accepted < drafted  # an exact copy, yet it misses whatever it cannot propose
    # sampling: the first token of N rows of one prompt, drafted (k=1) and verified, follows the
    # target's distribution. The exact copy proposes p restricted to the subset and
    # renormalized: it is accepted with probability m_in = p(subset), and a rejection's
    # recovered token comes from the residual, which lives outside the subset.
    from specrouter.config import SamplingParams
    from specrouter.decoding.sampling import SamplingTensors, process_logits

    n, prompt = 2000, prompts[2]
    target = load_llama_runner(tiny_pool_dirs["target"], dtype=torch.float64, max_len=64)
    logits = target.forward(ForwardBatch.build([0], [0], [prompt], [[len(prompt) - 1]]))[:, :, : mask.shape[0]]
    p = process_logits(logits, SamplingTensors.from_params([SamplingParams(temperature=0.8)]))[0, 0]
    m_in = float(p[mask].sum())
    assert 0.2 < m_in < 0.8  # both paths (accept, recover) are exercised
    sampled = sr.generate([prompt] * n, max_new_tokens=2, chain=["same-sub", "target"], k=1,
                          temperature=0.8, seed=0, ignore_eos=True)
    first = torch.tensor([o.token_ids[0] for o in sampled])
    accepted = torch.tensor([o.stats.accepted["same-sub>target"] for o in sampled])
    assert all(o.stats.drafted["same-sub>target"] == 1 for o in sampled)
    sigma = (m_in * (1 - m_in) / n) ** 0.5
    assert abs(accepted.double().mean().item() - m_in) < 5 * sigma
    assert torch.equal(mask[first], accepted.bool())  # accepted: in the subset; recovered: outside
    freq = torch.bincount(first, minlength=p.shape[0]).double() / n
    for tok in p.topk(5).indices.tolist():  # the most likely tokens, in and outside the subset
        sd = (p[tok] * (1 - p[tok]) / n).sqrt()
        assert abs(freq[tok] - p[tok]) < 5 * sd + 1e-9, (tok, freq[tok].item(), p[tok].item())


def test_exact_copy_accepts_everything_under_top_k_top_p(tiny_pool_dirs, prompts):
    """Every level samples from the same processed distribution: an exact copy of the target,
    as draft and as middle verifier, then accepts every candidate at temperature 1 with top-k /
    top-p (a level that skipped the filters would propose tokens the target never keeps)."""
    d = tiny_pool_dirs
    sr = SpecRouter.from_pretrained([d["same"], d["same"], d["target"]], target="target",
                                    names=["same", "same2", "target"], dtype="float64", adaptive=False)
    for filters in (dict(top_p=0.7), dict(top_k=5), dict(top_k=20, top_p=0.8)):
        for chain in (("same", "target"), ("same", "same2", "target")):
            outs = sr.generate(prompts, max_new_tokens=12, ignore_eos=True, chain=chain, k=4,
                               temperature=1.0, seed=0, **filters)
            for pair in zip(chain[:-1], chain[1:]):
                key = ">".join(pair)
                drafted = sum(o.stats.drafted[key] for o in outs)
                accepted = sum(o.stats.accepted[key] for o in outs)
                assert drafted > 0 and accepted == drafted, (filters, chain, key, accepted, drafted)
