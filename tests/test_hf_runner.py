"""The transformers fallback runner against the plain transformers model, in float64.

Three architectures, all random: a tiny Llama (the native runner's family, here through the
fallback), a tiny GPT-2 (learned absolute positions, a different cache layout) and a tiny Mistral
with a 4-token sliding window (shorter than the test sequences, so the window matters).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures import make_tiny_llama, make_tiny_tokenizer

from specrouter.errors import CheckpointError, ContextLengthError
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.hf import HFRunner, load_hf_runner

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31, 77]  # a fixed 13-token sequence


def _make_tiny_gpt2(out_dir):
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(out_dir, 320)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=128,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # widen the init so logits are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.to(torch.float64).save_pretrained(str(out_dir))
    return out_dir


def _make_tiny_mistral_sliding(out_dir, window=4):
    out = make_tiny_llama(out_dir, model_type="mistral", dtype=torch.float64,
                          max_position_embeddings=128, seed=2)
    config = json.loads((out / "config.json").read_text())
    config["sliding_window"] = window
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ckpts")
    return {
        "llama": make_tiny_llama(root / "llama", dtype=torch.float64, max_position_embeddings=128),
        "gpt2": _make_tiny_gpt2(root / "gpt2"),
        "mistral_sw4": _make_tiny_mistral_sliding(root / "mistral_sw4"),
    }


def test_sliding_window_is_in_effect(ckpts):
    runner = load_hf_runner(ckpts["mistral_sw4"], dtype=torch.float64)
    windowed = _plain_logits(runner, TOKENS)
    runner.model.config.sliding_window = None
    assert not torch.allclose(_plain_logits(runner, TOKENS)[6:], windowed[6:])


@pytest.fixture(scope="module", params=["llama", "gpt2", "mistral_sw4"])
def runner(request, ckpts) -> HFRunner:
    return load_hf_runner(ckpts[request.param], dtype=torch.float64, num_slots=4)


def _plain_logits(runner: HFRunner, tokens: list[int]) -> torch.Tensor:
    """The plain model's logits over a whole sequence, no cache: (T, V)."""
    with torch.no_grad():
        return runner.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].double()


def _run(runner, slot, start, new, positions=None):
    positions = list(range(len(new))) if positions is None else positions
    return runner.forward(ForwardBatch.build([slot], [start], [new], [positions]))[0]


def test_attributes(runner):
    assert runner.vocab_size == 320 and runner.dtype == torch.float64
    assert runner.max_context == 128 and runner.max_len == 128 and runner.num_slots == 4
    assert runner.num_params == sum(p.numel() for p in runner.model.parameters())


def test_prefill_then_steps_equal_full_sequence(runner):
    full = _plain_logits(runner, TOKENS)  # (13, V)
    slot = runner.allocate_slot()
    try:
        got = [_run(runner, slot, 0, TOKENS[:5])]  # prefill, logits everywhere
        for t in range(5, 9):  # one-token steps
            got.append(_run(runner, slot, t, TOKENS[t : t + 1]))
        got.append(_run(runner, slot, 9, TOKENS[9:]))  # a 4-token "verification" step
        got = torch.cat(got)
        assert got.dtype == torch.float64 and got.shape == full.shape
        torch.testing.assert_close(got, full, rtol=0, atol=1e-10)
        assert runner._caches[slot].get_seq_length() == len(TOKENS)
    finally:
        runner.free_slot(slot)
    assert slot not in runner._caches  # the freed slot's cache is dropped


def test_ragged_batch_over_noncontiguous_slots_equals_rows_alone(runner):
    # rows: (slot, prefix already cached, new tokens, logit positions)
    rows = [
        (3, TOKENS[:4], TOKENS[4:9], [0, 2, 4]),
        (1, TOKENS[:7], TOKENS[7:8], [0]),  # shorter row: T and G are padded
        (2, [], TOKENS[2:6], [3, 1]),  # a prefill inside the batch
    ]
    for slot, prefix, _, _ in rows:
        if prefix:
            _run(runner, slot, 0, prefix)
    batch = ForwardBatch.build(
        [r[0] for r in rows], [len(r[1]) for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    )
    got = runner.forward(batch)  # (3, 3, V)
    assert got.shape == (3, 3, runner.vocab_size)
    for b, (_, prefix, new, positions) in enumerate(rows):
        slot = 0  # the same row alone, in another slot
        if prefix:
            _run(runner, slot, 0, prefix)
        alone = _run(runner, slot, len(prefix), new, positions)
        # not bit-equal: padded logit positions change the lm_head matmul's shape
        torch.testing.assert_close(got[b, : len(positions)], alone, rtol=0, atol=1e-13)
        padding = got[b, len(positions) :]  # repeats of the last wanted position
        torch.testing.assert_close(padding, alone[-1:].expand_as(padding), rtol=0, atol=1e-13)
        plain = _plain_logits(runner, prefix + new)[len(prefix) + torch.tensor(positions)]
        torch.testing.assert_close(alone, plain, rtol=0, atol=1e-10)


def test_rollback_equals_fresh_prefill(runner):
    draft = [9, 8, 7]
    # slot 1: prefill 10 tokens, step once (11 cached), then roll back to 6 and feed a new draft
    _run(runner, 1, 0, TOKENS[:10])
    _run(runner, 1, 10, TOKENS[10:11])
    rolled = _run(runner, 1, 6, draft)
    assert runner._caches[1].get_seq_length() == 9
    # slot 2: a fresh prefill of the kept prefix, then the same draft
    _run(runner, 2, 0, TOKENS[:6])
    fresh = _run(runner, 2, 6, draft)
    # bit-equal for Llama; GPT-2's fused QKV addmm rounds differently for 10 vs 6 prefill rows
    torch.testing.assert_close(rolled, fresh, rtol=0, atol=1e-13)
    plain = _plain_logits(runner, TOKENS[:6] + draft)[6:]
    torch.testing.assert_close(rolled, plain, rtol=0, atol=1e-10)
    # rolling back to 0 restarts the slot
    restarted = _run(runner, 1, 0, TOKENS[:3])
    torch.testing.assert_close(restarted, _plain_logits(runner, TOKENS[:3]), rtol=0, atol=1e-10)


def test_contract_violations(runner):
    _run(runner, 0, 0, TOKENS[:3])
    with pytest.raises(RuntimeError, match="holds 3 cached positions but .* says starts=5"):
        _run(runner, 0, 5, TOKENS[5:6])
    _run(runner, 0, 0, TOKENS[:3])
    _run(runner, 1, 0, TOKENS[:4])
    bad = ForwardBatch.build([1, 0], [4, 5], [TOKENS[4:6], TOKENS[5:6]], [[0], [0]])
    with pytest.raises(RuntimeError, match="slot 0 holds 3"):
        runner.forward(bad)
    assert runner._caches[1].get_seq_length() == 4  # a rejected batch runs no row
    with pytest.raises(RuntimeError, match="appears twice"):
        runner.forward(ForwardBatch.build([1, 1], [4, 4], [[1], [2]], [[0], [0]]))
    with pytest.raises(RuntimeError, match="out of range"):
        _run(runner, 7, 0, TOKENS[:2])
    with pytest.raises(ContextLengthError, match="max_len=128"):
        _run(runner, 0, 127, TOKENS[:2])


def test_reserve_and_dtypes(ckpts):
    r = load_hf_runner(ckpts["llama"], name="d", num_slots=2, max_len=32)  # float32 by default
    assert (r.name, r.dtype, r.num_slots, r.max_len) == ("d", torch.float32, 2, 32)
    assert _run(r, r.allocate_slot(), 0, TOKENS[:4]).dtype == torch.float32
    with pytest.raises(ContextLengthError, match="context is 128"):
        r.reserve(1, 129)
    r.reserve(3, 128)
    assert [r.allocate_slot() for _ in range(3)] == [0, 1, 2] and not r._caches
    with pytest.raises(RuntimeError, match="all 3 cache slots"):
        r.allocate_slot()
    bf16 = load_hf_runner(ckpts["gpt2"], dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and _run(bf16, 0, 0, TOKENS[:3]).dtype == torch.float32


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_errors(ckpts, tmp_path):
    llama = ckpts["llama"]
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_runner(tmp_path / "nope")

    d = _copy(llama, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_runner(d)

    d = _copy(llama, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_hf_runner(d)

    d = _copy(llama, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot load the weights.*SafetensorError"):
        load_hf_runner(d)

    d = _copy(llama, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_hf_runner(d)

    from safetensors.torch import load_file, save_file

    d = _copy(llama, tmp_path / "missingkey")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks 1 weight.*layers.1.mlp.up_proj"):
        load_hf_runner(d)

    d = _copy(llama, tmp_path / "recurrent")
    config = json.loads((d / "config.json").read_text())
    config["layer_types"] = ["full_attention", "linear_attention"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="linear_attention"):
        load_hf_runner(d)


def test_remote_code_is_never_implied(ckpts, tmp_path):
    d = _copy(ckpts["llama"], tmp_path / "custom")
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = "specrouter_custom"
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig",
                          "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="trust_remote_code=True only if you trust it"):
        load_hf_runner(d)
