"""A position's logits are bitwise the same in a 1-token step, a k-token verification, a prefill
and a ragged multi-row batch (runners/linear.py: one row-invariant kernel per precision; the
attention, norms, RoPE and head likewise), in float32 and bfloat16, on the SmolLM2-135M shape
(random weights built from a config, no checkpoint on disk).

This is what makes greedy speculative decoding exact in float32 and bfloat16, not only float64:
the target's verification forward over k tokens computes the same bits as plain decoding's
1-token steps."""

import pytest
import torch

from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.kernels import PATHS, why_not, why_not_native
from specrouter.models.runners.linear import NATIVE_BY_PATH
from specrouter.models.runners.llama import LlamaArchitecture, LlamaRunner

SMOLLM2_135M = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
    tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=100000.0,
)


def random_runner(config: dict, dtype: torch.dtype, *, num_slots: int, max_len: int,
                  seed: int = 0, num_layers: int | None = None, kernels: str = "native") -> LlamaRunner:
    """A LlamaRunner with random weights (std 0.02, norms around 1) for `config`."""
    config = dict(config, num_hidden_layers=num_layers or config["num_hidden_layers"])
    arch = LlamaArchitecture.from_config(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in arch.expected_shapes().items():
        t = torch.randn(shape, generator=g) * 0.02
        tensors[name] = 1.0 + t * 5 if name.endswith("norm.weight") else t
    return LlamaRunner(arch, tensors, name="random", dtype=dtype, num_slots=num_slots, max_len=max_len,
                       kernels=kernels)


def _run(runner: LlamaRunner, rows: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
    """One forward of rows (slot, start, tokens), logits at every new token; per row (n, V)."""
    batch = ForwardBatch.build(
        [s for s, _, _ in rows], [p for _, p, _ in rows], [t for _, _, t in rows],
        [list(range(len(t))) for _, _, t in rows],
    )
    logits = runner.forward(batch)
    return [logits[b, : len(t)] for b, (_, _, t) in enumerate(rows)]


@pytest.fixture(
    scope="module",
    params=[(d, k) for k in PATHS for d in (torch.float32, torch.bfloat16)],
    ids=[f"{d}-{k}" for k in PATHS for d in ("fp32", "bf16")],
)
def runner(request):
    """Each kernel path (the native AVX-512-BF16, AVX-512F and AVX2 linears, and torch's
    fallback ones), in each precision."""
    torch.manual_seed(0)
    dtype, kernels = request.param
    reason = None if kernels == "torch" else (why_not(kernels) or why_not_native())
    if reason:  # the CPU lacks the path's flags (named), or SPECROUTER_KERNELS=torch
        pytest.skip(reason)
    # the 135M widths, vocabulary and heads; 6 of its 30 layers (each layer runs the same kernels)
    runner = random_runner(SMOLLM2_135M, dtype, num_slots=6, max_len=100, num_layers=6, kernels=kernels)
    # claimed but not built fails, never silently runs torch's kernels
    assert (runner._ops is not None) == (kernels != "torch"), "native kernels claimed but not built"
    if kernels != "torch":
        assert runner._kernel == NATIVE_BY_PATH[kernels][dtype]
    return runner


def test_logits_are_bitwise_the_same_however_the_rows_are_grouped(runner):
    V = runner.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (58,), generator=g).tolist()  # positions cross a key chunk
    cont = torch.randint(0, V, (9,), generator=g).tolist()
    other = torch.randint(0, V, (80,), generator=g).tolist()
    P = len(prompt)

    # reference: the prompt one token at a time, then 1-token steps (plain decoding)
    seq = prompt + cont
    ref = torch.cat([_run(runner, [(0, i, [tok])])[0] for i, tok in enumerate(seq)])  # (P+9, V)

    # a prefill of the whole prompt in one forward computes the same bits
    prefill = _run(runner, [(1, 0, prompt)])[0]
    assert torch.equal(prefill, ref[:P])

    # k-token verifications after the prompt (2 and 3 rows are padded to 4), rolled back each time
    for k in (2, 3, 4, 5, 9):
        assert torch.equal(_run(runner, [(1, P, cont[:k])])[0], ref[P : P + k]), f"k={k}"
    # a verification that starts mid-way (cache written by the k=9 forward above)
    assert torch.equal(_run(runner, [(1, P + 4, cont[4:7])])[0], ref[P + 4 : P + 7])

    # ragged batches over non-contiguous slots in any order: decode rows of other sequences,
    # a prefill of another prompt and a verification of ours, in one forward
    _run(runner, [(3, 0, other[:70])])
    _run(runner, [(5, 0, other[5:17])])
    out = _run(runner, [(5, 12, other[17:18]), (1, P, cont[:6]), (4, 0, other[:11]), (3, 70, other[70:73])])
    assert torch.equal(out[1], ref[P : P + 6])
    out = _run(runner, [(3, 73, other[73:74]), (1, P + 2, cont[2:3]), (5, 12, other[20:25])])
    assert torch.equal(out[1], ref[P + 2 : P + 3])
    # two rows of the same sequence content in different slots agree with each other too
    out = _run(runner, [(2, 0, seq[:66]), (4, 0, seq[:66])])
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], ref[:66])


def test_the_fused_decoder_stack_computes_the_python_loops_bits(runner):
    """The native `decoder_layers` op (the whole stack in one call) against the Python loop over
    the same ops (`_fused = None`): bitwise the same logits and cache, on a ragged batch (packed
    tokens), a full batch, and the features; the torch path has no fused op."""
    if runner._ops is None:
        assert runner._fused is None
        return
    assert runner._fused is not None, "every linear is native, so the fused stack must serve"
    V = runner.vocab_size
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 30))
    rows = [(0, 0, a[:33]), (2, 0, b[:7]), (3, 0, a[:1])]

    def forward(fused: bool):
        saved = runner._fused
        runner._fused = saved if fused else None
        try:
            first = _run(runner, rows)  # ragged: the packed path
            full = _run(runner, [(0, 33, a[33:38]), (2, 7, b[7:12])])  # every row 5 tokens
            batch = ForwardBatch.build([3], [1], [a[1:4]], [[0, 1, 2]])
            feats = runner.forward_with_features(batch)[1]
            return first + full + [feats, runner._k[-1][:4, :, :40].clone()]
        finally:
            runner._fused = saved

    fused, loop = forward(True), forward(False)
    for x, y in zip(fused, loop):
        assert torch.equal(x, y)


def test_the_fused_stacks_bits_do_not_depend_on_how_its_threads_share_the_work(runner):
    """`decoder_layers` runs in one parallel region whose threads share tiles and attention items
    statically (the default), dynamically or guided, or as one fork and join per op ("ops"):
    bitwise the same logits and cache under every schedule, on a ragged batch and a full one.
    The per-thread phase timers (`stack_profile`) count cycles only while switched on."""
    if runner._ops is None:
        return
    ops = runner._ops
    V = runner.vocab_size
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 30))

    def forward():
        first = _run(runner, [(0, 0, a[:21]), (2, 0, b[:9]), (3, 0, a[:1])])  # ragged: packed rows
        full = _run(runner, [(0, 21, a[21:38]), (2, 9, b[9:26])])  # 17 tokens a row
        return first + full + [runner._k[-1][:4, :, :40].clone(), runner._v[0][:4, :, :40].clone()]

    try:
        ops.set_stack_schedule("static", 1)
        ops.stack_profile(True)
        ref = forward()
        prof = ops.stack_profile(False)
        assert prof[0].sum() > 0 and prof[:, :, 0].sum() > 0  # thread 0 worked, timed
        assert ops.stack_profile(False).sum() == 0  # read and reset; off: nothing counted
        forward()
        assert ops.stack_profile(False).sum() == 0
        for kind, chunk in (("dynamic", 1), ("dynamic", 3), ("guided", 1), ("ops", 1)):
            ops.set_stack_schedule(kind, chunk)
            for x, y in zip(forward(), ref):
                assert torch.equal(x, y), (kind, chunk)
        with pytest.raises(RuntimeError, match="static, dynamic, guided or ops"):
            ops.set_stack_schedule("fastest", 1)
    finally:
        ops.set_stack_schedule("static", 1)
        ops.stack_profile(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_stack_with_widths_its_tiles_do_not_divide(dtype):
    """An intermediate width that is not a whole number of linear tiles (200): gate and up are not
    paired tile by tile, silu * up runs as a pass of its own; a hidden width of 7 heads of 16 and
    a ragged batch: still the Python loop's bits."""
    reason = why_not_native()
    if reason:
        pytest.skip(reason)
    config = dict(SMOLLM2_135M, hidden_size=112, intermediate_size=200, num_attention_heads=7,
                  num_key_value_heads=1, vocab_size=512)
    runner = random_runner(config, dtype, num_slots=3, max_len=64, num_layers=2)
    assert runner._fused is not None
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 512, (40,), generator=g).tolist()
    rows = [(0, 0, a[:13]), (1, 0, a[5:7]), (2, 0, a[:1])]
    fused = _run(runner, rows) + _run(runner, [(0, 13, a[13:30]), (1, 2, a[7:24])])
    runner._fused, saved = None, runner._fused
    try:
        loop = _run(runner, rows) + _run(runner, [(0, 13, a[13:30]), (1, 2, a[7:24])])
    finally:
        runner._fused = saved
    for x, y in zip(fused, loop):
        assert torch.equal(x, y)
