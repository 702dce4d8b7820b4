"""The native Llama-family runner against transformers, on tiny random checkpoints.

float64 comparisons are exact up to rounding (~1e-15): transformers' RMSNorm and rotary
embedding compute in float32 even for a float64 model, so the float64 reference patches them to
compute in float64 (`_float64_reference`); everything else is transformers' own code.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import make_tiny_llama

from specrouter.errors import CheckpointError, ContextLengthError
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.llama import (
    LlamaArchitecture,
    LlamaRunner,
    load_llama_runner,
)
from specrouter.models.runners.rope import rope_parameters_from_config

transformers = pytest.importorskip("transformers")

F64 = torch.float64
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so head_dim 16 has all three bands
}
# variant -> make_tiny_llama kwargs (plus post-processing keys handled in _build)
VARIANTS = {
    "llama-tied": dict(model_type="llama"),
    "llama-untied-sharded": dict(model_type="llama", tie_word_embeddings=False, shard=True),
    "qwen2-bias": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False),
    "rope-llama3": dict(model_type="llama", rope_scaling=LLAMA3),
    "rope-linear": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-dynamic": dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "rope-yarn": dict(
        model_type="llama",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "old-style-config": dict(model_type="llama", old_config=True),
    "head-dim-24": dict(model_type="llama", head_dim=24),
}


def _save_llama_head_dim(out: Path, head_dim: int, dtype: torch.dtype) -> None:
    """make_tiny_llama has no head_dim knob: a llama with head_dim != hidden / heads."""
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.to(dtype).save_pretrained(str(out))


def _shard(out: Path) -> None:
    """Split model.safetensors into two shards with an index, as large checkpoints are."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {n: files[i % 2] for i, n in enumerate(names)}
    for f in files:
        shard = {n: tensors[n] for n in names if weight_map[n] == f}
        save_file(shard, str(out / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def _to_old_config(out: Path) -> None:
    """Rewrite config.json the pre-transformers-5 way: top-level rope_theta + rope_scaling.type."""
    cfg = json.loads((out / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 100000.0  # SmolLM2's theta
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """variant -> checkpoint dir (float64 weights), built once per module on first use."""
    root, built = tmp_path_factory.mktemp("ckpts"), {}

    def get(variant: str) -> Path:
        if variant not in built:
            kw = dict(VARIANTS[variant])
            shard, old = kw.pop("shard", False), kw.pop("old_config", False)
            head_dim = kw.pop("head_dim", None)
            out = root / variant
            if head_dim is not None:
                _save_llama_head_dim(out, head_dim, F64)
            else:
                make_tiny_llama(out, dtype=F64, with_tokenizer=False, seed=len(built), **kw)
            if shard:
                _shard(out)
            if old:
                _to_old_config(out)
            built[variant] = out
        return built[variant]

    return get


@contextlib.contextmanager
def _float64_reference():
    """Make transformers' RMSNorm and RoPE compute in float64 for a float64 model."""
    from transformers.modeling_rope_utils import dynamic_rope_update
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    def norm_forward(self, h):
        x = h.to(torch.promote_types(h.dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(h.dtype)

    @dynamic_rope_update
    def rope_forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)

    with pytest.MonkeyPatch.context() as mp:
        models = ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2"), (modeling_mistral, "Mistral"))
        for module, prefix in models:
            mp.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", norm_forward)
            mp.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", rope_forward)
        yield


_HF_MODELS: dict = {}


def hf_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype = F64) -> torch.Tensor:
    """transformers' logits (B, T, V) for full sequences `ids` (B, T), no cache."""
    key = (str(path), dtype)
    if key not in _HF_MODELS:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        _HF_MODELS[key] = model.eval()
    model = _HF_MODELS[key]
    ctx = _float64_reference() if dtype == F64 else contextlib.nullcontext()
    with ctx, torch.no_grad():
        return model(ids).logits


def run(runner: LlamaRunner, slots, starts, new_tokens, positions=None) -> torch.Tensor:
    """One forward; logits at every new token by default."""
    new_tokens = [t.tolist() if isinstance(t, torch.Tensor) else t for t in new_tokens]
    if positions is None:
        positions = [list(range(len(t))) for t in new_tokens]
    return runner.forward(ForwardBatch.build(slots, starts, new_tokens, positions))


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-9) -> None:
    err, scale = (out - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rel * max(1.0, scale), f"max abs error {err:.3e} (logit scale {scale:.2f})"


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- exactness vs transformers ---------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_incremental_match_transformers(ckpt, variant):
    path = ckpt(variant)
    ids = _ids(1, 24)
    ref = hf_logits(path, ids)[0]  # (24, V)
    runner = load_llama_runner(path, dtype=F64, num_slots=2, max_len=64)
    assert runner.vocab_size == 320 and runner.max_context == 512
    out = run(runner, [1], [0], [ids[0, :10]])
    assert out.dtype == F64 and out.shape == (1, 10, 320)
    assert_close(out[0], ref[:10])
    pos = 10
    for n in (1, 3, 1, 4, 5):  # decode steps and multi-token (verification) steps
        out = run(runner, [1], [pos], [ids[0, pos : pos + n]])
        assert_close(out[0], ref[pos : pos + n])
        pos += n


def test_num_params_match_transformers(ckpt):
    for variant in ("llama-tied", "llama-untied-sharded", "qwen2-bias"):
        path = ckpt(variant)
        runner = load_llama_runner(path, dtype=F64, max_len=8)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=F64)
        assert runner.num_params == hf.num_parameters(), variant


# ---- ragged batches ---------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [[2, 0, 3], [1, 2, 3]], ids=["scattered", "contiguous"])
def test_ragged_batch_equals_rows_alone_and_transformers(ckpt, slots):
    path = ckpt("qwen2-bias")
    ids = _ids(3, 20, seed=1)
    ref = hf_logits(path, ids)  # (3, 20, V)
    runner = load_llama_runner(path, dtype=F64, num_slots=4, max_len=32)
    solo = load_llama_runner(path, dtype=F64, num_slots=1, max_len=32)
    lengths = [5, 9, 3]
    for b, (slot, n) in enumerate(zip(slots, lengths)):
        run(runner, [slot], [0], [ids[b, :n]], [[n - 1]])
    for step in ([3, 1, 4], [2, 4, 1], [1, 1, 1]):
        starts = list(lengths)
        new = [ids[b, s : s + n] for b, (s, n) in enumerate(zip(starts, step))]
        out = run(runner, slots, starts, new)  # (3, max(step), V)
        for b, (s, n) in enumerate(zip(starts, step)):
            assert_close(out[b, :n], ref[b, s : s + n])
            run(solo, [0], [0], [ids[b, :s]], [[s - 1]])
            alone = run(solo, [0], [s], [new[b]])[0]
            assert_close(out[b, :n], alone, rel=1e-12)
            assert torch.all(out[b, n:] == out[b, n - 1])  # padded positions repeat the last
        lengths = [s + n for s, n in zip(starts, step)]


def test_uniform_batches_and_padding_at_the_end_of_the_cache(ckpt):
    path = ckpt("llama-tied")
    ids = _ids(2, 16, seed=2)
    ref = hf_logits(path, ids)
    runner = load_llama_runner(path, dtype=F64, num_slots=4, max_len=16)
    for slots in ([3, 1], [0, 1]):  # uniform start/length: index path, then the slice path
        out = run(runner, slots, [0, 0], [ids[0, :6], ids[1, :6]])
        assert_close(out, ref[:, :6])
        out = run(runner, slots, [6, 6], [ids[0, 6:7], ids[1, 6:7]])  # B=2, T=1: no mask
        assert_close(out, ref[:, 6:7])
    # row 0 fills the cache to its last position, and its padding would land past max_len
    run(runner, [2], [0], [ids[0, :14]], [[13]])
    out = run(runner, [2, 1], [14, 7], [ids[0, 14:16], ids[1, 7:12]])
    assert_close(out[0, :2], ref[0, 14:16])
    assert_close(out[1], ref[1, 7:12])
    with pytest.raises(ContextLengthError):
        run(runner, [2], [15], [ids[0, :2]])


def test_logits_only_where_asked_and_one_token_masks_the_key_chunk_tail(ckpt, monkeypatch):
    import specrouter.models.runners.llama as llama
    from specrouter.models.runners.attention import KEY_CHUNK

    path = ckpt("llama-tied")
    ids = _ids(2, 10, seed=6)
    ref = hf_logits(path, ids)
    runner = load_llama_runner(path, dtype=F64, num_slots=2, max_len=16)
    out = run(runner, [0, 1], [0, 0], [ids[0, :8], ids[1, :5]], [[7, 2], [4]])
    assert out.shape == (2, 2, 320)
    assert_close(out[0], ref[0, [7, 2]])
    assert_close(out[1], ref[1, [4, 4]])  # padded by repeating the last index
    masks = []
    attention = llama.attention

    def spy(q, keys, values, blocked):
        masks.append(~blocked[..., :1, :])  # the one query row (the rest pad to MIN_ROWS)
        return attention(q, keys, values, blocked)

    monkeypatch.setattr(llama, "attention", spy)
    out = run(runner, [1], [5], [ids[1, 5:6]])
    # B=1, T=1 at position 5: keys come in one whole chunk, those past position 5 are masked
    assert len(masks) == 2 and all(m.shape[-1] == KEY_CHUNK for m in masks)
    assert all(bool(m[..., :6].all()) and not bool(m[..., 6:].any()) for m in masks)
    assert_close(out[0], ref[1, 5:6])


# ---- rollback ---------------------------------------------------------------------------------
def test_rollback_equals_fresh_prefill(ckpt):
    path = ckpt("llama-tied")
    ids = _ids(1, 16, seed=3)[0]
    runner = load_llama_runner(path, dtype=F64, num_slots=2, max_len=32)
    # fresh: slot 1 prefills 5 tokens, then 4 more
    run(runner, [1], [0], [ids[:5]])
    fresh = run(runner, [1], [5], [ids[5:9]])
    # same shapes after a rollback: slot 0 prefills 5, writes 4 wrong tokens, rolls back to 5
    run(runner, [0], [0], [ids[:5]])
    run(runner, [0], [5], [torch.flip(ids[5:9], [0])])
    assert torch.equal(run(runner, [0], [5], [ids[5:9]]), fresh)  # bitwise
    for layer in range(2):
        assert torch.equal(runner._k[layer][0, :, :9], runner._k[layer][1, :, :9])
        assert torch.equal(runner._v[layer][0, :, :9], runner._v[layer][1, :, :9])
    # longer history, rolled back from 12 to 5: equal to the fresh prefill up to rounding
    run(runner, [0], [0], [ids[:8]])
    run(runner, [0], [8], [ids[8:12]])
    rolled = run(runner, [0], [5], [ids[5:9]])
    assert_close(rolled, fresh, rel=1e-12)
    assert_close(rolled[0], hf_logits(path, ids[None, :9])[0, 5:9])
    step = run(runner, [0], [9], [ids[9:10]])
    assert_close(step, run(runner, [1], [9], [ids[9:10]]), rel=1e-12)


# ---- float32 / bfloat16 -------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "llama-untied-sharded"])
def test_float32_and_bfloat16_agree_with_transformers(ckpt, variant):
    path = ckpt(variant)
    ids = _ids(1, 12, seed=4)
    ref = hf_logits(path, ids)[0]
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        runner = load_llama_runner(path, dtype=dtype, max_len=32)
        assert runner.dtype == dtype
        out = torch.cat([run(runner, [0], [0], [ids[0, :8]])[0], run(runner, [0], [8], [ids[0, 8:]])[0]])
        assert out.dtype == torch.float32
        assert_close(out.double(), ref, rel=rel)
        if dtype == torch.float32:  # and transformers' own float32 run
            assert_close(out, hf_logits(path, ids, torch.float32)[0], rel=1e-5)


# ---- config parsing ---------------------------------------------------------------------------
def test_rope_config_old_and_new_style_agree():
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    new = {"max_position_embeddings": 64, "rope_parameters": linear}
    scaling = {"type": "linear", "factor": 2.0}
    old = {"max_position_embeddings": 64, "rope_theta": 5e5, "rope_scaling": scaling}
    assert rope_parameters_from_config(new) == rope_parameters_from_config(old)
    default = {"rope_type": "default", "rope_theta": 1e4}
    assert rope_parameters_from_config({"max_position_embeddings": 64}) == default
    with pytest.raises(CheckpointError, match="unsupported RoPE type 'longrope'"):
        rope_parameters_from_config({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    with pytest.raises(CheckpointError, match="low_freq_factor"):
        llama3 = {"rope_type": "llama3", "factor": 8.0}
        rope_parameters_from_config({"rope_scaling": llama3, "max_position_embeddings": 8})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        rope_parameters_from_config({"rope_theta": 1e4, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_config_defaults_follow_transformers(model_type):
    minimal = dict(
        model_type=model_type,
        vocab_size=100,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=32,  # qwen2 / mistral default to 32 / 8 KV heads when unset
    )
    arch = LlamaArchitecture.from_config(minimal)
    hf = transformers.AutoConfig.for_model(**minimal)
    assert arch.num_kv_heads == hf.num_key_value_heads
    assert arch.head_dim == (getattr(hf, "head_dim", None) or 8)
    assert arch.rms_norm_eps == hf.rms_norm_eps
    assert arch.tie_word_embeddings == hf.tie_word_embeddings
    assert arch.max_position_embeddings == hf.max_position_embeddings
    assert arch.rope["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert arch.sliding_window == getattr(hf, "sliding_window", None)


# ---- errors -------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_checkpoint_errors(ckpt, tmp_path):
    good = ckpt("llama-tied")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_llama_runner(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_llama_runner(tmp_path / "empty")
    no_weights = _copy(good, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_llama_runner(no_weights)
    corrupt = _copy(good, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x13\x00garbage, not a safetensors file" * 10)
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        load_llama_runner(corrupt)
    longrope = _copy(good, tmp_path / "longrope")
    _edit_config(longrope, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="unsupported RoPE type"):
        load_llama_runner(longrope)
    gpt2 = _copy(good, tmp_path / "gpt2")
    _edit_config(gpt2, model_type="gpt2")
    with pytest.raises(CheckpointError, match="not supported by the native runner"):
        load_llama_runner(gpt2)
    untied = _copy(good, tmp_path / "untied")  # config says untied, the file has no lm_head
    _edit_config(untied, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lacks tensors \\['lm_head.weight'\\]"):
        load_llama_runner(untied)
    misshaped = _copy(good, tmp_path / "misshaped")
    _edit_config(misshaped, intermediate_size=96)
    with pytest.raises(CheckpointError, match="has shape"):
        load_llama_runner(misshaped)


def test_sliding_window_and_context_limits(ckpt, tmp_path):
    windowed = _copy(ckpt("mistral"), tmp_path / "windowed")
    _edit_config(windowed, sliding_window=16)
    with pytest.raises(CheckpointError, match="sliding-window"):
        load_llama_runner(windowed, max_len=64)
    runner = load_llama_runner(windowed, dtype=F64)  # default max_len stays inside the window
    assert runner.max_len == runner.max_context == 16
    runner = load_llama_runner(ckpt("llama-tied"), dtype=F64, num_slots=1, max_len=8)
    assert runner.max_context == 512
    assert load_llama_runner(ckpt("llama-tied"), dtype=F64).max_len == 512  # min(512, 2048)
    with pytest.raises(ContextLengthError):
        runner.reserve(1, 513)
    slot = runner.allocate_slot()
    with pytest.raises(RuntimeError):
        runner.allocate_slot()
    runner.free_slot(slot)
    runner.reserve(3, 40)  # grows (only while no slot is in use)
    assert (runner.num_slots, runner.max_len) == (3, 40)
    assert sorted(runner.allocate_slot() for _ in range(3)) == [0, 1, 2]
    runner.reserve(2, 10)  # already large enough: nothing changes
    assert (runner.num_slots, runner.max_len) == (3, 40)
    ids = _ids(1, 40, seed=5)
    out = run(runner, [2], [0], [ids[0]], [[39]])
    assert_close(out[0], hf_logits(ckpt("llama-tied"), ids)[0, 39:])


def test_native_kernels_run_a_ragged_batch_on_its_valid_tokens_only(ckpt, monkeypatch):
    """A ragged batch on the native kernels costs its valid tokens: every linear gets
    sum(num_tokens) rows, not rows x the widest row, and each row's logits are bitwise those
    of the row run alone (the kernels are row-invariant, so packing changes no bit)."""
    from specrouter.models.runners.kernels import rowinv, why_not_native

    if why_not_native() is not None:
        pytest.skip(why_not_native())
    assert rowinv() is not None, "the CPU has the native kernels' flags but they did not build"
    path = ckpt("llama-tied")
    native = load_llama_runner(path, dtype=torch.float32, num_slots=3, max_len=32)
    solo = load_llama_runner(path, dtype=torch.float32, num_slots=1, max_len=32)
    assert native.packs_ragged
    ids = _ids(3, 20, seed=4)
    for slot in range(3):
        run(native, [slot], [0], [ids[slot, :6]], [[5]])
    rows_seen = []

    class Counting:
        def __getattr__(self, name):
            op = getattr(rowinv(), name)
            if name not in ("linear", "linear512"):  # the AVX2 / AVX-512 linears
                return op
            return lambda x, *a, **k: (rows_seen.append(x.shape[0]), op(x, *a, **k))[1]

    widths = [5, 1, 2]
    new = [ids[b, 6 : 6 + n] for b, n in enumerate(widths)]
    from specrouter.models.runners import linear as linear_module

    from specrouter.models.runners import llama as llama_module

    monkeypatch.setattr(linear_module, "_rowinv", Counting())
    monkeypatch.setattr(llama_module, "FUSED_STACK", False)  # the Python loop's linears, counted
    # (the fused stack runs the same ops on the same packed rows: test_row_invariance.py)
    out = run(native, [0, 1, 2], [6] * 3, new)
    monkeypatch.undo()
    assert set(rows_seen) == {sum(widths)}  # every linear: 8 rows, not 3 x 5 = 15
    for b, n in enumerate(widths):
        run(solo, [0], [0], [ids[b, :6]], [[5]])
        assert torch.equal(out[b, :n], run(solo, [0], [6], [new[b]])[0])


# -- shapes the native kernels do not tile evenly (issue 25 item 2) ------------------------------
# head size 12 (hidden 48, 4 heads), 10 (hidden 40: its linears' input width is not a whole
# number of the bfloat16 kernel's blocks either) and 8; grouped-query ratios 2, 1, 4 and 6
ODD_POOL = {
    "target": dict(hidden_size=48, num_heads=4, num_kv_heads=2, num_layers=2, seed=1),
    "mid": dict(hidden_size=48, num_heads=4, num_kv_heads=4, num_layers=1, seed=2),
    "draft": dict(hidden_size=40, num_heads=4, num_kv_heads=1, num_layers=1, seed=3),
    "wide": dict(hidden_size=48, num_heads=6, num_kv_heads=1, num_layers=1, seed=4),
}


@pytest.fixture(scope="module")
def odd_pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("oddpool")
    return {n: make_tiny_llama(root / n, tie_word_embeddings=False, **kw) for n, kw in ODD_POOL.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_odd_head_sizes_and_mixed_gqa_ratios_decode_exactly(odd_pool, dtype):
    """A head size that is not a multiple of 8 (12, 10) and grouped-query ratios that differ
    between the levels of a chain run (no `head counts / sizes do not match` mid-request) and
    every chain's greedy output is plain decoding's, on the kernels the runner chose."""
    from fixtures import named_router, repeating_prompts

    names = tuple(ODD_POOL)
    sr = named_router(odd_pool, names, dtype)
    prompts = repeating_prompts((4, 11, 19))
    out = lambda **kw: [r.token_ids for r in sr.generate(prompts, max_new_tokens=16, ignore_eos=True, **kw)]  # noqa: E731
    plain = out(chain=("target",))
    assert all(len(p) == 16 for p in plain)
    for chain in (("draft", "target"), ("mid", "target"), ("wide", "draft", "target"), ("ngram", "mid", "target")):
        for k in (1, 4):
            assert out(chain=chain, k=k) == plain, (chain, k)
    assert out() == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_odd_head_size_runs_on_the_native_attention_and_matches_torch(odd_pool, dtype):
    """Head size 12 on the native attention kernel (when it runs here): a 5-token forward's
    logits are bitwise those of 1-token steps, and close to the torch kernels' ones."""
    from specrouter.models.runners.kernels import why_not_native

    kinds = ["torch"] + (["native"] if why_not_native() is None else [])  # claimed: must build
    prompt = list(range(3, 12))
    got = {}
    for kind in kinds:
        r = load_llama_runner(odd_pool["target"], dtype=dtype, num_slots=1, max_len=32, kernels=kind)
        assert (r._ops is not None) == (kind == "native")
        r.forward(ForwardBatch.build([0], [0], [prompt[:4]], [[3]]))
        steps = [r.forward(ForwardBatch.build([0], [4 + i], [[t]], [[0]]))[0, 0] for i, t in enumerate(prompt[4:])]
        wide = r.forward(ForwardBatch.build([0], [4], [prompt[4:]], [list(range(5))]))[0]  # (5, V)
        assert torch.equal(torch.stack(steps), wide), kind
        got[kind] = wide
    if "native" in got:
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(got["native"], got["torch"], rtol=tol, atol=tol)
