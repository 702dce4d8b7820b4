"""The runner's GPU path (models/runners/triton/, issue 33), tested without a GPU: the Triton
kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py where
torch sees no CUDA). Each kernel is bitwise invariant (a row alone vs in a batch, 1 vs k+1 new
tokens, first vs last in its tile) and agrees with torch's float64 reference within tolerance; the
runner on them is invariant end to end and the engine's greedy output equals target-only's."""

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton", reason="the dev extra installs triton (the GPU path's kernels)")

from specrouter.models.runners.base import ForwardBatch  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("the interpreter tests run where torch sees no GPU (the `cuda` tests run the kernels there)",
                allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_res", [False, True])
def test_matmul_is_row_invariant_and_close_to_torch(dtype, bias_res):
    from specrouter.models.runners.triton.matmul import BLOCK_M, linear

    g = torch.Generator().manual_seed(0)
    N, K, M = 96, 200, 2 * BLOCK_M + 3  # N, K not multiples of the tiles; M over two tiles
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias_res else None
    x = torch.randn(M, K, generator=g).to(dtype)
    r = torch.randn(M, N, generator=g).to(dtype) if bias_res else None
    full = linear(x, w, b, r)  # (M, N)
    for i in (0, 5, BLOCK_M - 1, BLOCK_M, M - 1):  # alone vs in the batch, any place in a tile
        alone = linear(x[i : i + 1], w, b, None if r is None else r[i : i + 1])
        assert torch.equal(alone[0], full[i]), i
    for lo, n in ((0, 2), (3, 5), (M - 17, 17)):  # 1 vs k+1 rows
        part = linear(x[lo : lo + n], w, b, None if r is None else r[lo : lo + n])
        assert torch.equal(part, full[lo : lo + n]), (lo, n)
    ref = x.double() @ w.double().T + (0 if b is None else b.double()) + (0 if r is None else r.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(full.double(), ref, rtol=tol, atol=tol)


def test_matmul_differs_from_a_reference_that_is_wrong():
    """Negative control: the comparison above can fail (a transposed weight does not pass)."""
    from specrouter.models.runners.triton.matmul import linear

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 64, generator=g), torch.randn(3, 64, generator=g)
    assert not torch.allclose(linear(x, w), x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_row_invariant_and_close_to_torch(dtype):
    from specrouter.models.runners.triton.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(2)
    H, eps = 96, 1e-5
    x, w = torch.randn(9, H, generator=g).to(dtype), (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    full = rms_norm(x, w, eps)
    for i in range(9):
        assert torch.equal(rms_norm(x[i : i + 1], w, eps)[0], full[i])
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(full.double(), ref, rtol=tol, atol=tol)


def _attention_reference(q, kc, vc, slot, start, t):
    """float64 softmax(q . k) v of one query over keys 0..start+t (q already scaled)."""
    h_per_kv = q.shape[0] // kc.shape[1]
    out = []
    for h in range(q.shape[0]):
        k = kc[slot, h // h_per_kv, : start + t + 1].double()  # (L, D)
        v = vc[slot, h // h_per_kv, : start + t + 1].double()
        out.append(torch.softmax(k @ q[h].double(), 0) @ v)
    return torch.stack(out)  # (NH, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_invariant_and_close_to_torch(dtype):
    """Contexts past one KV block (64), GQA (4 query heads on 2 KV heads), ragged rows."""
    from specrouter.models.runners.triton.attention import attention

    g = torch.Generator().manual_seed(3)
    S, KV, NH, P, D = 3, 2, 4, 256, 16
    kc, vc = torch.randn(S, KV, P, D, generator=g).to(dtype), torch.randn(S, KV, P, D, generator=g).to(dtype)
    T = 5
    q = (torch.randn(3, T, NH, D, generator=g) * 0.5).to(dtype)
    slots, starts, nums = torch.tensor([2, 0, 1]), torch.tensor([150, 7, 63]), torch.tensor([5, 3, 1])
    full = attention(q, kc, vc, slots, starts, nums)  # (B, T, NH, D)
    for b in range(3):
        for t in range(int(nums[b])):
            one = attention(q[b : b + 1, t : t + 1], kc, vc, slots[b : b + 1], starts[b : b + 1] + t,
                            torch.tensor([1]))  # the same query as a 1-token step
            assert torch.equal(one[0, 0], full[b, t]), (b, t)
            ref = _attention_reference(q[b, t], kc, vc, int(slots[b]), int(starts[b]), t)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(full[b, t].double(), ref, rtol=tol, atol=tol), (b, t)
    alone = attention(q[:1], kc, vc, slots[:1], starts[:1], nums[:1])  # row 0 without the others
    assert torch.equal(alone[0], full[0])


# -- the runner on the Triton path ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    from fixtures import make_tiny_llama

    root = tmp_path_factory.mktemp("triton")
    target = make_tiny_llama(root / "target", hidden_size=64, num_layers=2, seed=11, tie_word_embeddings=False)
    draft = make_tiny_llama(root / "draft", hidden_size=64, num_layers=2, seed=12, init_from=target, noise=0.3,
                            tie_word_embeddings=False)
    return {"target": target, "draft": draft}


def _runner(path, kernels, **kw):
    from specrouter.models.runners.llama import load_llama_runner

    return load_llama_runner(path, dtype=torch.float32, kernels=kernels, num_slots=3, max_len=160, **kw)


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_runner_logits_are_invariant_on_the_triton_path(tiny_fp32):
    r = _runner(tiny_fp32["target"], "triton")
    assert r._kernel == "triton" and r._gpu
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, 320, (90,), generator=g).tolist()
    other = torch.randint(0, 320, (40,), generator=g).tolist()
    whole = r.forward(ForwardBatch.build([0], [0], [toks], [list(range(90))]))[0]  # (90, V): one prefill
    r.forward(ForwardBatch.build([1], [0], [toks[:80]], [[79]]))
    steps = [r.forward(ForwardBatch.build([1], [80 + i], [[toks[80 + i]]], [[0]]))[0, 0] for i in range(10)]
    assert torch.equal(torch.stack(steps), whole[80:])  # 1-token steps == one 90-token forward
    r.forward(ForwardBatch.build([2], [0], [other], [[39]]))
    # a (k+1)-token verify of row 1 beside a 1-token step of row 2, ragged
    batch = ForwardBatch.build([1, 2], [84, 40], [toks[84:89], [5]], [list(range(5)), [0]])
    out = r.forward(batch)
    assert torch.equal(out[0], whole[84:89])
    ref = _runner(tiny_fp32["target"], "torch").forward(ForwardBatch.build([0], [0], [toks], [list(range(90))]))[0]
    assert torch.allclose(whole, ref, rtol=1e-4, atol=1e-4)  # the torch kernels, within tolerance


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_engine_greedy_on_the_triton_path_equals_target_only(tiny_fp32):
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.models.pool import Pool

    pool = Pool.load([str(tiny_fp32["draft"]), str(tiny_fp32["target"])], target="target", dtype="float32", suffix=False)
    runners = {n: _runner(r.checkpoint_dir, "triton") for n, r in pool.runners.items()}
    for n, r in runners.items():
        r.checkpoint_dir = pool.runners[n].checkpoint_dir
    pool = dataclasses.replace(pool, runners=runners)
    prompts = [[9, 10, 11, 9, 10, 11, 9, 10], [40, 41]]  # ragged: two rows, different lengths
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(prompts)
    outs = {}
    for chain, k in (((pool.target,), 1), (("draft", "target"), 3), (("ngram", "draft", "target"), 2)):
        engine = Engine(pool)
        outs[chain] = [s.tokens[len(p):] for s, p in zip(engine.generate_ids(prompts, params, chain=chain, k=k), prompts)]
    first = outs[(pool.target,)]
    assert all(o == first for o in outs.values()), outs


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_bucketed_forwards_pad_without_changing_a_bit(tiny_fp32):
    """The CUDA-graph wrapper's bucket logic (graphs.py), eagerly: a batch padded to its bucket
    (rows at the wrapper's pad slot, tokens to the scratch row) gives the same logits."""
    from specrouter.models.runners.triton.graphs import GraphedRunner, bucket_of

    assert bucket_of(1, 1) == (1, 1) and bucket_of(3, 4) == (4, 5) and bucket_of(8, 17) == (8, 17)
    assert bucket_of(17, 1) is None and bucket_of(1, 18) is None
    eager, graphed = _runner(tiny_fp32["target"], "triton"), GraphedRunner(_runner(tiny_fp32["target"], "triton"), capture=False)
    graphed.reserve(3, 160)
    assert graphed.num_slots == 4  # one more, the padding rows'
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (10, 66, 5)]  # 66: past one key block
    for r in (eager, graphed):
        slots = [r.allocate_slot() for _ in rows]
        for s, x in zip(slots, rows):
            r.runner.forward(ForwardBatch.build([s], [0], [x], [[len(x) - 1]])) if r is graphed else \
                r.forward(ForwardBatch.build([s], [0], [x], [[len(x) - 1]]))
    assert graphed.pad_slot is None or graphed.pad_slot not in slots
    batch = ForwardBatch.build(slots, [10, 66, 5], [[1, 2, 3], [4], [5, 6, 7, 8]], [[0, 1, 2], [0], [0, 1, 2, 3]])
    out = graphed.forward(batch)  # bucket (4, 5)
    assert graphed.replays == 1 and out.shape == (3, 4, 320) and graphed.pad_slot not in slots
    assert torch.equal(out, eager.forward(batch))
