"""The generic transformers fallback runner: any `AutoModelForCausalLM`, one `DynamicCache` per
slot, rows run one at a time.

It exists so that architectures the native runner does not know still serve, slower: every row
is its own transformers forward (~3 ms of Python overhead each on CPU), and a `DynamicCache`
re-concatenates its tensors on every step. Use it for correctness and coverage, not speed.

Rollback follows the runner contract (base.py): the cache of a slot is cropped to `starts[b]`
before the row runs, so passing a smaller start than last time discards the positions after it.
Cropping a `DynamicCache` drops the tail in place; the result equals a fresh prefill of the kept
prefix (tested in float64).

Supported: decoder-only models whose cache is per-token key/value state (full, sliding-window or
chunked attention). The cache is built without the config, so every layer keeps all positions
(a sliding window is enforced by the attention mask, not by evicting keys): memory grows with
the whole context, and cropping stays exact past the window. Models with recurrent state (Mamba, linear attention, hybrid layers) cannot
be rolled back by cropping and are rejected at load time, or at the first forward when their
config does not say so.

transformers versions: 5.x names the cache argument `cache=` (`past_key_values=` is deprecated
and goes in 5.40) and drops `cache_position`; 4.56-4.x take `past_key_values=` and
`cache_position=`. The runner reads the model's forward signature once and passes what it takes.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import DynamicCache

from specrouter.errors import CheckpointError, ContextLengthError
from specrouter.models.runners.base import ForwardBatch, ModelRunner

# Layer kinds (config.layer_types) whose cache is per-token KV state, so cropping is exact.
# "moe"/"mlp" layers keep no cache at all.
_CROPPABLE_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "moe", "mlp"}

# Weight files transformers can load from a local directory.
_WEIGHT_GLOBS = (
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json"
)

# When a config states no context limit at all (rare), this stands in for max_position_embeddings.
_UNKNOWN_CONTEXT = 1 << 20


class HFRunner(ModelRunner):
    """A `ModelRunner` over a loaded transformers causal LM (see the module docstring).

    Per-slot state is only `self._caches[slot]`, a `DynamicCache` (batch 1) created on the slot's
    first forward and dropped by `free_slot`. Build it with `load_hf_runner`, or directly from a
    model already in memory (`HFRunner(model, name="x")`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        name: str,
        num_slots: int = 1,
        max_len: int | None = None,
    ) -> None:
        self.model = model.eval()
        self.name = name
        text_config = _text_config(model.config)
        self.max_context = _max_context(text_config)
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(out_emb, "weight", None)
        width = weight.shape[0] if weight is not None else text_config.vocab_size
        self.vocab_size = int(width)  # logits width, padding rows included
        self.num_params = sum(p.numel() for p in model.parameters())
        first = next(model.parameters())
        self.dtype = first.dtype
        self.device = first.device
        # logits come back in float64 for float64 models (exact tests), else float32
        self.logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

        params = inspect.signature(model.forward).parameters
        # transformers >= 5 calls it `cache`; 4.56-4.x (and most remote code) `past_key_values`
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params
        self._takes_logits_to_keep = "logits_to_keep" in params

        self._caches: dict[int, object] = {}  # slot -> DynamicCache
        self.num_slots = 0
        self.max_len = 0
        self.reserve(num_slots, self.max_context if max_len is None else max_len)

    # ------------------------------------------------------------------ contract

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Record the limits; nothing is preallocated (DynamicCache grows). Drops every slot's
        cache, as a reallocation would: call with no live sequence."""
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"model {self.name!r}: num_slots and max_len must be >= 1, "
                             f"got {num_slots} and {max_len}")
        if max_len > self.max_context:
            raise ContextLengthError(
                f"model {self.name!r}: {max_len} positions requested, but its context is "
                f"{self.max_context} (max_position_embeddings); lower max_len / max_new_tokens "
                "or shorten the prompt"
            )
        self.reallocating()  # parked prefix-cache slots are dropped with the caches
        self.num_slots = num_slots
        self.max_len = max_len
        self._caches.clear()

    def on_slot_freed(self, slot: int) -> None:
        self._caches.pop(slot, None)

    def slot_bytes(self, slot: int) -> int:
        """The bytes the slot's DynamicCache holds now (the storage of its tensors: a cropped
        cache keeps its storage until it grows again); 0 before its first forward."""
        cache = self._caches.get(slot)
        return 0 if cache is None else _cache_bytes(cache)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run every row on its own (ragged rows, one DynamicCache each); see ModelRunner.forward.
        Every row is checked before any runs, so a rejected batch leaves all slots unchanged."""
        B, G = batch.logit_positions.shape
        self._check(batch)
        out = torch.empty(B, G, self.vocab_size, dtype=self.logits_dtype, device=self.device)
        tokens = batch.tokens.to(self.device)
        logit_positions = batch.logit_positions.to(self.device)
        for b in range(B):
            slot, start, n = batch.slots_list[b], batch.starts_list[b], batch.num_tokens_list[b]
            cache = self._caches.get(slot)
            if cache is None or start == 0:
                cache = self._caches[slot] = DynamicCache()
            cached = cache.get_seq_length()
            if cached > start:
                cache.crop(start - cached)  # negative: drop the tail (transformers 4.56 and 5.x)

            positions = torch.arange(start, start + n, device=self.device)  # (n,)
            kwargs = {
                "input_ids": tokens[b : b + 1, :n],  # (1, n)
                "position_ids": positions.unsqueeze(0),  # (1, n)
                self._cache_kwarg: cache,
                "use_cache": True,
            }
            if self._takes_cache_position:
                kwargs["cache_position"] = positions
            wanted = logit_positions[b]  # (G,) indices into the n new tokens
            if self._takes_logits_to_keep:
                kwargs["logits_to_keep"] = wanted  # lm_head only at the G wanted positions
            logits = self.model(**kwargs).logits[0]  # (G, V) or (n, V)
            if not self._takes_logits_to_keep:
                logits = logits[wanted]  # (G, V)
            out[b] = logits[:, : self.vocab_size]

            if cache.get_seq_length() != start + n:
                self._caches.pop(slot, None)
                raise CheckpointError(
                    f"model {self.name!r} ({type(self.model).__name__}) did not keep a per-token "
                    "KV cache (length "
                    f"{cache.get_seq_length()} after a forward, expected {start + n}); its "
                    "state cannot be rolled back, so the transformers fallback cannot serve it"
                )
        return out

    def _check(self, batch: ForwardBatch) -> None:
        """Raise on a contract violation (RuntimeError) or a row past max_len."""
        if len(set(batch.slots_list)) != len(batch.slots_list):
            raise RuntimeError(f"model {self.name!r}: a slot appears twice in one batch "
                               f"{batch.slots_list}")
        for slot, start, n in zip(batch.slots_list, batch.starts_list, batch.num_tokens_list):
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(f"model {self.name!r}: slot {slot} out of range "
                                   f"0..{self.num_slots - 1}")
            if start + n > self.max_len:
                raise ContextLengthError(
                    f"model {self.name!r}: slot {slot} would hold {start + n} positions, "
                    f"more than max_len={self.max_len}"
                )
            cache = self._caches.get(slot)
            cached = cache.get_seq_length() if cache is not None else 0
            if cached < start:
                raise RuntimeError(
                    f"model {self.name!r}: slot {slot} holds {cached} cached positions but the "
                    f"forward says starts={start} (runner contract: the caller must first feed "
                    "every position it claims is cached)"
                )


def load_hf_runner(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    num_slots: int = 1,
    max_len: int | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> HFRunner:
    """Load a Hugging Face checkpoint directory (config.json + safetensors / .bin weights) with
    `AutoModelForCausalLM` and wrap it in an `HFRunner`.

    name: pool name (default: the directory's name). dtype: compute dtype (a torch dtype or its
    name, e.g. "bfloat16"). max_len: default the model's max_position_embeddings.
    trust_remote_code: run the checkpoint's own Python code; never implied, off by default.
    Loading is local only (`local_files_only=True`): a missing directory never reaches the hub.
    Raises CheckpointError for a missing directory, config.json or weights, unreadable or
    corrupt files, weights missing from the checkpoint, and unsupported architectures.
    """
    import transformers

    path = Path(path)
    name = name or path.name
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
    if not path.is_dir():
        raise CheckpointError(
            f"model {name!r}: checkpoint directory {str(path)!r} does not exist (expected a "
            "Hugging Face model directory with config.json and *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model {name!r}: no config.json in {str(path)!r}; is this a "
                              "Hugging Face model directory?")
    if not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
        raise CheckpointError(
            f"model {name!r}: no weights in {str(path)!r} (looked for *.safetensors, "
            "pytorch_model*.bin and their *.index.json); the download may be incomplete"
        )

    common = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), **common)
    except Exception as e:  # invalid JSON, unknown model_type, remote code refused
        raise CheckpointError(f"model {name!r}: cannot read {str(path / 'config.json')!r}: "
                              f"{_describe(e)}{_remote_code_hint(e, trust_remote_code)}") from e
    layer_types = getattr(_text_config(config), "layer_types", None) or []
    stateful = sorted({t for t in layer_types if t not in _CROPPABLE_LAYER_TYPES})
    if stateful:
        raise CheckpointError(
            f"model {name!r}: layers of kind {stateful} keep recurrent state that cannot be "
            "rolled back by cropping; the transformers fallback serves attention-only models"
        )
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=dtype, output_loading_info=True, **common
        )
    except Exception as e:  # corrupt safetensors, shape mismatch, not a causal LM, ...
        raise CheckpointError(f"model {name!r}: cannot load the weights in {str(path)!r}: "
                              f"{_describe(e)}{_remote_code_hint(e, trust_remote_code)}") from e
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(
            f"model {name!r}: the checkpoint in {str(path)!r} lacks {len(missing)} weight(s) "
            f"({shown}); they would be random. The files are incomplete or of another model"
        )
    model.to(device)
    return HFRunner(model, name=name, num_slots=num_slots, max_len=max_len)


def _cache_bytes(cache) -> int:
    """Bytes of every tensor a DynamicCache holds (transformers 5.x: `layers[i].keys/values` and
    any other tensor state of a layer; 4.56-4.x: `key_cache` / `value_cache`), each storage once."""
    tensors = []
    for layer in getattr(cache, "layers", None) or ():
        tensors += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    if not getattr(cache, "layers", None):
        tensors += [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _text_config(config):
    """The decoder's config (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _max_context(text_config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return _UNKNOWN_CONTEXT


def _describe(e: Exception, limit: int = 300) -> str:
    """The exception as one short line: its type and its text, whitespace collapsed."""
    text = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _remote_code_hint(e: Exception, trust_remote_code: bool) -> str:
    """A hint for the two transformers errors whose own text points elsewhere."""
    if not trust_remote_code and "trust_remote_code" in str(e):
        return (" (the checkpoint ships its own code: pass trust_remote_code=True only if you "
                "trust it)")
    if "ignore_mismatched_sizes" in str(e):
        return " (a weight's shape does not match config.json: files of different models?)"
    return ""


__all__ = ["HFRunner", "load_hf_runner"]
