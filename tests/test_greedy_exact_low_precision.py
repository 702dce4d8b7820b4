"""Greedy equivalence in float32 and bfloat16, not only float64: with one row-invariant kernel per
precision (runners/linear.py, runners/attention.py) a k-token verification computes the bits of
plain decoding's 1-token steps, so every chain, k, router decision and ragged batch gives exactly
the output of plain decoding at the same precision.

The target's output head is scaled down so its logits sit close together: in bfloat16 many
positions are near-ties, where any difference in the last bit flips the argmax. The negative
control swaps in linears whose multi-token forwards round one ulp differently and must see
outputs change."""

import pytest
import torch
from fixtures import TINY_POOL, named_router, repeating_prompts

PROMPT_LENS = (3, 9, 14, 22)
MAX_NEW = 24
CHAINS = [
    ("draft", "target"),
    ("ngram", "target"),
    ("same", "target"),
    ("draft", "mid", "target"),
    ("ngram", "draft", "target"),
    ("ngram", "random", "mid", "target"),
]


@pytest.fixture(scope="module")
def flat_pool(tmp_path_factory):
    """The conftest pool's shapes, with heads scaled to near-tie logits (float32 checkpoints)."""
    from fixtures import make_near_tie_pool, make_tiny_llama

    root = tmp_path_factory.mktemp("flatpool")
    dirs = make_near_tie_pool(root, max_position_embeddings=256)
    target = dirs["target"]
    kw = dict(hidden_size=64, num_layers=3, tie_word_embeddings=False, max_position_embeddings=256)
    return {
        **dirs,
        "same": make_tiny_llama(root / "same", seed=4, init_from=target, noise=0.0, **kw),
        "random": make_tiny_llama(root / "random", hidden_size=32, num_layers=1, num_heads=2,
                                  num_kv_heads=1, seed=5, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts(PROMPT_LENS)


def _router(pool, dtype):
    return named_router(pool, TINY_POOL, dtype)


def _outputs(sr, prompts, **kw):
    return [r.token_ids for r in sr.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, **kw)]


def _on_path(path: str, monkeypatch) -> None:
    """Every model loaded after this runs kernel path `path` (SPECROUTER_KERNELS): skipped
    where the CPU lacks its flags (the reason names them); claimed but not built fails."""
    from specrouter.models.runners.kernels import kernel_path, rowinv, why_not, why_not_native

    reason = why_not(path) or (why_not_native() if path != "torch" else None)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("SPECROUTER_KERNELS", path)
    kernel_path.cache_clear()
    monkeypatch.setattr("specrouter.models.runners.kernels.kernel_path", kernel_path)
    assert path == "torch" or rowinv() is not None, "native kernels claimed but not built"


@pytest.fixture
def path(request, monkeypatch):
    from specrouter.models.runners.kernels import kernel_path

    _on_path(request.param, monkeypatch)
    yield request.param
    monkeypatch.undo()
    kernel_path.cache_clear()


PATH_IDS = ["amx", "avx512bf16", "avx512", "avx2", "torch"]


@pytest.mark.parametrize("path", PATH_IDS, indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_chain_k_and_the_router_equal_plain_decoding(flat_pool, prompts, dtype, path):
    """Per kernel path (bits differ between paths; exactness is against plain decoding on the
    same path)."""
    from specrouter.models.runners.linear import kernels

    assert kernels().startswith(path + ":")
    sr = _router(flat_pool, dtype)
    plain = _outputs(sr, prompts, chain=("target",))
    # plain decoding one request at a time equals the ragged batch of all four
    assert [_outputs(sr, [p], chain=("target",))[0] for p in prompts] == plain
    for chain in CHAINS:
        for k in (1, 3, 6):
            assert _outputs(sr, prompts, chain=chain, k=k) == plain, (chain, k)
    assert _outputs(sr, prompts) == plain  # the router on: chains and k chosen every cycle


def test_negative_control_a_multi_token_forward_that_rounds_differently_fails(flat_pool, prompts, monkeypatch):
    """Linears whose multi-token forwards round one ulp differently from 1-token steps (as
    MKL's GEMV/GEMM switch and SDPA's shape-dependent blocking do) must make some chain
    diverge from plain decoding: the equality above is a test that can fail."""
    import specrouter.models.runners.llama as llama

    linear = llama.linear

    def shape_dependent(x, w):
        y = linear(x, w)
        if x.shape[0] <= 1:  # a 1-token step of one row: as shipped
            return y
        return torch.nextafter(y, torch.full_like(y, float("inf")))  # one ulp up

    def one_by_one(**kw):  # one row at a time: plain decoding's steps are all 1-row
        return [_outputs(sr, [p], **kw)[0] for p in prompts]

    sr = _router(flat_pool, "bfloat16")
    monkeypatch.setattr(llama, "linear", shape_dependent)
    monkeypatch.setattr(llama, "FUSED_STACK", False)  # the Python loop, which calls `linear`
    plain = one_by_one(chain=("target",))
    differ = sum(one_by_one(chain=c, k=k) != plain for c in CHAINS for k in (3, 6))
    assert differ > 0
