"""Seeded sampling's noise on the GPU path (models/runners/triton/noise.py), tested without a GPU:
the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py
where torch sees no CUDA). It chooses `coupled_argmax_reference`'s token on every row (peaked and
flat rows, filtered tokens, top-k masks, vocabularies over several tiles and not whole blocks),
a kernel with another stream constant or another key does not (negative controls), NaN rows are
marked -1 and raised on at the host, and the engine's seeded output through the kernel equals
the CPU paths'.

Bitwise noise: the interpreter's float64 log is numpy's, torch's CPU log differs from it by one
ulp on ~0.3% of inputs, so the tests compare the chosen tokens (what sampling uses); on CUDA both
are libdevice's log."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the dev extra installs triton (the GPU path's kernels)")

from specrouter.decoding import noise  # noqa: E402
from specrouter.decoding.noise import (  # noqa: E402
    BLOCK,
    check_tokens,
    coupled_argmax_reference,
    coupled_argmax_triton,
    position_keys,
    seed_key,
)

if torch.cuda.is_available():
    pytest.skip("the interpreter tests run where torch sees no GPU", allow_module_level=True)


def keys_for(n: int, seed: int = 0, position: int = 7) -> torch.Tensor:
    seeds = torch.tensor([seed_key(seed + i) for i in range(n)], dtype=torch.long)
    return position_keys(seeds, torch.full((n,), position, dtype=torch.long))


def rows(N: int, V: int, temperature: float, dtype, seed: int) -> torch.Tensor:
    """(N, V) scores: Gaussian logits / temperature; row 1 filtered past V/2 (-inf), row 2 a
    top-k mask (5 tokens kept), the last row flat (every block a candidate)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(N, V, generator=g, dtype=torch.float64) / temperature
    if N > 1:
        s[1, V // 2:] = -torch.inf
    if N > 2:
        s[2] = s[2].masked_fill(s[2] < s[2].topk(5).values[-1], -torch.inf)
    if N > 3:
        s[-1] = 0.0
    return s.to(dtype)


TILE = 2048  # the kernel's tokens per loop step (TILE_BLOCKS x BLOCK), checked below


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,V,temperature", [(1, 300, 0.7), (9, 300, 1.0), (9, 1000, 0.05), (5, 1000, 5.0),
                                             (4, 2 * TILE + 300, 0.7), (6, 2 * TILE, 1.0)])
def test_kernel_chooses_the_reference_token(N, V, temperature, dtype):
    """V 300 / 1000 / 2 TILE + 300 are not whole blocks; the last two span several tiles."""
    from specrouter.models.runners.triton.noise import TILE_BLOCKS

    assert TILE == TILE_BLOCKS * BLOCK
    scores = rows(N, V, temperature, dtype, seed=V + N)
    for position in (0, 7, 123456):
        keys = keys_for(N, seed=V, position=position)
        assert torch.equal(coupled_argmax_triton(scores, keys), coupled_argmax_reference(scores, keys)), position


def test_kernel_on_many_keys_and_edge_rows():
    """36 keys on a peaked and a flat row; a row of one finite token; a row all -inf (index 0,
    as torch.argmax); a strided (non-contiguous) view."""
    V = TILE + 76  # two tiles, the second partial
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, V, generator=g) * torch.tensor([[4.0], [0.0]])  # peaked, flat
    scores = base.repeat_interleave(18, 0)  # (36, V)
    keys = position_keys(torch.full((36,), seed_key(99)), torch.arange(36))
    assert torch.equal(coupled_argmax_triton(scores, keys), coupled_argmax_reference(scores, keys))
    edge = torch.full((2, V), -torch.inf)
    edge[0, TILE + 53] = 1.0
    assert coupled_argmax_triton(edge, keys[:2]).tolist() == [TILE + 53, 0] == coupled_argmax_reference(edge, keys[:2]).tolist()
    wide = torch.randn(3, 2 * V, generator=g)
    view = wide[:, ::2]  # stride 2 along the vocabulary
    assert torch.equal(coupled_argmax_triton(view, keys[:3]), coupled_argmax_reference(view, keys[:3]))


def _kernel(scores, keys, **change):
    from specrouter.models.runners.triton import noise as kernel

    consts = dict(block=BLOCK, mix=(noise._M1, noise._M2), golden=noise._GOLDEN,
                  streams=(noise._STREAM["token"], noise._STREAM["block_min"], noise._STREAM["block_arg"]))
    return kernel.coupled_argmax(scores, keys, **(consts | change))


def test_negative_controls_another_stream_or_key_fails():
    """The comparison can fail: the kernel with another token-stream constant, swapped block
    streams, another golden ratio constant, or the next position's keys chooses other tokens.
    (The token stream alone moves fewer rows: a row's winner is often a block's argmin token,
    whose noise is the block minimum's.)"""
    N, V = 24, 300
    scores = rows(N, V, 1.0, torch.float32, seed=1)
    scores[-1] = torch.randn(V)  # no flat row here: a control row must depend on the noise
    keys = keys_for(N, seed=5)
    ref = coupled_argmax_reference(scores, keys)
    assert torch.equal(_kernel(scores, keys), ref)  # the constants as noise.py has them: equal
    s = noise._STREAM
    for change in (dict(streams=(s["token"] + 1, s["block_min"], s["block_arg"])),
                   dict(streams=(s["token"], s["block_arg"], s["block_min"])),
                   dict(golden=noise._GOLDEN + 2)):
        assert (_kernel(scores, keys, **change) != ref).sum() >= 3, change
    other = keys_for(N, seed=5, position=8)
    assert (coupled_argmax_triton(scores, other) != ref).sum() >= N // 2


def test_nan_rows_are_marked_and_raised_on_the_host():
    """No host sync in the kernel: a NaN row gets -1, the other rows their token;
    `check_tokens` (the executor, where the tokens reach the host) raises as the torch path."""
    scores = torch.randn(3, 300)
    scores[1, 200] = float("nan")
    keys = keys_for(3)
    out = coupled_argmax_triton(scores, keys)
    assert out[1] == -1
    assert out[[0, 2]].tolist() == coupled_argmax_reference(scores[[0, 2]], keys[[0, 2]]).tolist()
    with pytest.raises(RuntimeError, match="NaN"):
        check_tokens(out)
    assert check_tokens(out[[0, 2]]) is not None


def test_cuda_tensors_dispatch_to_the_kernel():
    """noise.coupled_argmax picks the Triton kernel for CUDA tensors only (CPU: unchanged)."""
    from specrouter.models.runners.triton import triton_available

    class OnCuda:
        device = torch.device("cuda")

    assert noise._use_triton(OnCuda()) is triton_available()
    assert noise._use_triton(torch.zeros(1, 3)) is False


def test_engine_seeded_output_through_the_kernel_equals_the_cpu_paths(tiny_pool_dirs, monkeypatch):
    """The engine, seeded t=0.7 with top-k and top-p rows, on target-only and draft > target: the
    same tokens whether the noise runs on the CPU paths or (forced) through the Triton kernel, and
    the kernel was called."""
    from specrouter.config import SamplingParams
    from specrouter.engine.engine import Engine
    from specrouter.models.pool import Pool

    pool = Pool.load([str(tiny_pool_dirs["draft"]), str(tiny_pool_dirs["target"])], target="target",
                     dtype="float32", suffix=False)
    prompts = [[9, 10, 11, 9, 10, 11, 9, 10], [40, 41]]
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.7, seed=11),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=12)]

    def run(chain, k):
        engine = Engine(pool.with_fresh_drafters())
        return [s.tokens[len(p):] for s, p in zip(engine.generate_ids(prompts, params, chain=chain, k=k), prompts)]

    chains = (((pool.target,), 1), (("draft", pool.target), 3))
    cpu = {c: run(c, k) for c, k in chains}
    calls = []

    def forced(scores):
        calls.append(scores.shape)
        return True

    monkeypatch.setattr(noise, "_use_triton", forced)
    kern = {c: run(c, k) for c, k in chains}
    assert calls, "the kernel was never called"
    assert kern == cpu
    assert cpu[chains[0][0]] == cpu[chains[1][0]]  # and the chain does not change a seeded output


COMPILE = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specrouter.decoding import noise as n
from specrouter.models.runners.triton import noise as k

target = GPUTarget("cuda", 90, 32)  # H100 / H200
consts = dict(S_TOKEN=n._STREAM["token"], S_MIN=n._STREAM["block_min"], S_ARG=n._STREAM["block_arg"],
              M1=n._M1, M2=n._M2, GOLDEN=n._GOLDEN, BLOCK=n.BLOCK, TB=k.TILE_BLOCKS)
for dt in ("*fp32", "*fp64", "*bf16"):
    sig = dict(s_ptr=dt, k_ptr="*i64", out_ptr="*i64", V="i32", stride_s="i32", **{c: "constexpr" for c in consts})
    c = triton.compile(ASTSource(fn=k._coupled_argmax_kernel, signature=sig, constexprs=consts),
                       target=target, options={"num_warps": k.NUM_WARPS})
    assert c.asm["cubin"], dt


@triton.jit
def bad(x_ptr, n):  # runs in the interpreter; the compiler refuses it (a loop-carried type change)
    acc = 0.0
    for i in range(n):
        acc = tl.load(x_ptr + i).to(tl.float64)
    tl.store(x_ptr, acc)


try:
    triton.compile(ASTSource(fn=bad, signature=dict(x_ptr="*fp64", n="i32")), target=target)
except Exception as e:
    print("negative control refused:", type(e).__name__)
else:
    raise SystemExit("the compiler accepted a kernel it must refuse")
"""


def test_kernel_compiles_for_a_gpu_without_one(tmp_path):
    """The interpreter does not type-check as the compiler does (a loop-carried variable that
    changes type runs there and fails to compile): compile the kernel for sm_90 down to a cubin
    (Triton ships ptxas; no GPU needed) in a process without TRITON_INTERPRET, and check that the
    compiler refuses such a kernel (negative control)."""
    script = tmp_path / "compile_noise.py"
    script.write_text(COMPILE)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "negative control refused" in r.stdout
