"""The native runner for Llama-family checkpoints (llama / SmolLM, qwen2, mistral).

Plain tensor code over a preallocated, slot-addressed KV cache (gpt-fast style): one K and one V
buffer per layer, each (num_slots, n_kv_heads, max_len + 1, head_dim). Position `max_len` is a
scratch row: the right-padding of a ragged batch writes there, so it never clobbers valid cache.
Weights are fused at load (q|k|v and gate|up), cos/sin tables are precomputed, and the forward
takes its fast paths from the batch's Python mirrors, never from a device sync.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specrouter.errors import CheckpointError, ContextLengthError, DeviceError
from specrouter.models.runners.attention import attention, blocked_keys, padded_length
from specrouter.models.runners.base import ForwardBatch, ModelRunner
from specrouter.models.runners.huge_pages import huge_page_copies
from specrouter.models.runners.kernels import PATHS, rowinv, why_not
from specrouter.models.runners.linear import (
    ATEN_LINEAR,
    MM,
    NATIVE_KERNELS,
    ONEDNN_BLOCKED,
    ROWINV,
    ROWINV512,
    ROWINV_AMX,
    ROWINV_DP,
    TRITON,
    Linear,
    kernel_for,
    kernel_for_torch,
    linear,
    linear_add,
)
from specrouter.models.runners.rope import (
    apply_rope,
    rope_inv_freq,
    rope_parameters_from_config,
    rope_tables,
)

log = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# transformers' config defaults for keys a config.json may omit, per model_type
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072}
# a draft checkpoint's frequent-token list, {"token_ids": [...], ...}: the runner computes only
# those logits (see LlamaRunner._make_embed_and_head)
DRAFT_VOCAB_FILE = "draft_vocab.json"
# the native decoder stack in one call (`decoder_layers`) where it serves; False: the Python loop
# over the same ops (per-op profiles, tests that patch an op such as `linear`)
FUSED_STACK = True
_DEFAULT_KV_HEADS = {"llama": None, "qwen2": 32, "mistral": 8}  # None: = num_attention_heads


@dataclass(frozen=True)
class LlamaArchitecture:
    """What the runner needs from a config.json, validated."""

    model_type: str  # llama | qwen2 | mistral
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size // num_heads (config.head_dim)
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # qwen2 always; llama with attention_bias
    o_bias: bool  # llama with attention_bias
    mlp_bias: bool  # llama with mlp_bias
    max_position_embeddings: int
    sliding_window: int | None  # the attention window when one applies, else None
    rope: dict  # normalized RoPE parameters (see rope.rope_parameters_from_config)

    @staticmethod
    def from_config(config: dict[str, Any]) -> "LlamaArchitecture":
        """Parse a config.json dict; raises CheckpointError for what the runner cannot run."""
        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {mt!r} is not supported by the native runner (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); use the transformers fallback runner"
            )
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads", _DEFAULT_KV_HEADS[mt]) or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            act = config.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise CheckpointError(f"hidden_act={act!r} is not supported (only silu)")
            if head_dim % 2:
                raise CheckpointError(f"head_dim={head_dim} is odd: rotary embeddings need an even head size")
            if heads % kv_heads:
                raise CheckpointError(f"num_attention_heads={heads} is not a multiple of {kv_heads=}")
            config = {"max_position_embeddings": _DEFAULT_MAX_POSITIONS[mt], **config}
            max_pos = int(config["max_position_embeddings"])
            window = None
            if mt == "mistral":
                window = config.get("sliding_window", 4096)
            elif mt == "qwen2":
                layer_types = config.get("layer_types") or []
                sliding = "sliding_attention" in layer_types or (
                    not layer_types
                    and config.get("use_sliding_window", False)
                    and config.get("max_window_layers", 28) < int(config["num_hidden_layers"])
                )
                window = config.get("sliding_window", 4096) if sliding else None
            attention_bias = bool(config.get("attention_bias", False))
            return LlamaArchitecture(
                model_type=mt,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=mt == "qwen2" or (mt == "llama" and attention_bias),
                o_bias=mt == "llama" and attention_bias,
                mlp_bias=mt == "llama" and bool(config.get("mlp_bias", False)),
                max_position_embeddings=max_pos,
                sliding_window=int(window) if window is not None else None,
                rope=rope_parameters_from_config(config),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has an invalid value: {e}") from None

    @property
    def max_context(self) -> int:
        """max_position_embeddings, capped at the sliding window when one applies (the runner
        attends over the whole context, which equals sliding-window attention only up to it)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names (without the `model.` prefix) -> shapes."""
        H, D, KV, I = self.hidden_size, self.head_dim, self.num_kv_heads, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (self.vocab_size, H),
            "norm.weight": (H,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            proj = {"q": (self.num_heads * D, H), "k": (KV * D, H), "v": (KV * D, H)}
            for n, s in proj.items():
                shapes[f"{p}self_attn.{n}_proj.weight"] = s
                if self.qkv_bias:
                    shapes[f"{p}self_attn.{n}_proj.bias"] = (s[0],)
            shapes[f"{p}self_attn.o_proj.weight"] = (H, self.num_heads * D)
            if self.o_bias:
                shapes[f"{p}self_attn.o_proj.bias"] = (H,)
            for n, s in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
                shapes[f"{p}mlp.{n}_proj.weight"] = s
                if self.mlp_bias:
                    shapes[f"{p}mlp.{n}_proj.bias"] = (s[0],)
            shapes[f"{p}input_layernorm.weight"] = (H,)
            shapes[f"{p}post_attention_layernorm.weight"] = (H,)
        return shapes


def read_checkpoint(
    path: str | Path,
) -> tuple[dict[str, Any], LlamaArchitecture, dict[str, torch.Tensor]]:
    """Read config.json and the safetensors weights (single file or sharded with an index) of a
    Hugging Face checkpoint directory. Returns (config, architecture, tensors by name without
    the `model.` prefix, as stored). Raises CheckpointError with what is missing or broken."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{str(root)!r} is not a directory: expected a Hugging Face checkpoint")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{str(root)!r} has no config.json: not a Hugging Face checkpoint")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from None
    arch = LlamaArchitecture.from_config(config)
    expected = arch.expected_shapes()

    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read the shard index {index}: {e}") from None
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(root)!r} has no *.safetensors weights")

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    name = key[len("model.") :] if key.startswith("model.") else key
                    if name in expected and name not in tensors:
                        tensors[name] = sf.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {str(root)!r} lacks tensors {missing[:5]}{more}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} of {str(root)!r} has shape {tuple(tensors[name].shape)}, "
                f"the config implies {shape}"
            )
    return config, arch, tensors


class LlamaRunner(ModelRunner):
    """A Llama-family causal LM on a slot-addressed KV cache (contract: runners/base.py).

    RMSNorm follows transformers: in float32 for float32/bfloat16 models (the normalized
    activations are cast back before the weight multiply), in float64 for float64 models."""

    def __init__(
        self,
        arch: LlamaArchitecture,
        tensors: dict[str, torch.Tensor],
        *,
        name: str,
        dtype: torch.dtype = torch.float32,
        num_slots: int = 1,
        max_len: int | None = None,
        device: torch.device | str = "cpu",
        draft_vocab: list[int] | None = None,
        kernels: str = "native",
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"unsupported dtype {dtype}: use float32, bfloat16 or float64")
        self.arch, self.name, self.dtype, self.device = arch, name, dtype, torch.device(device)
        self.vocab_size = arch.vocab_size
        self.max_context = arch.max_context
        self.num_params = sum(t.numel() for t in tensors.values())
        self._logits_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        # norms, RoPE + attention and the MLP's activation on the native row-invariant
        # kernels (kernels/rowinv.cpp, linear512.cpp) where they run, else on torch's; "native"
        # on the CPU: the process's kernel path (kernels.kernel_path()), a path name forces one;
        # on a GPU ("native" on CUDA, or "triton" anywhere: the interpreter on CPU) on the
        # batch-invariant Triton kernels (runners/triton/)
        if kernels not in ("native", "triton", *PATHS):
            raise ValueError(f"kernels must be 'native', 'triton' or one of {PATHS}, got {kernels!r}")
        if kernels not in ("native", "torch", "triton") and why_not(kernels):
            raise RuntimeError(f"kernels={kernels!r}: {why_not(kernels)}")
        self._gpu = kernels == "triton" or (kernels == "native" and self.device.type == "cuda")
        if self._gpu:
            _check_gpu_path(dtype, self.device)
        native = (kernels not in ("torch", "triton") and dtype in (torch.float32, torch.bfloat16)
                  and self.device.type == "cpu")
        self._ops = rowinv() if native else None
        self.packs_ragged = self._ops is not None  # _forward_native packs ragged batches
        self.supports_trees = not self._gpu  # token trees on the native kernels and torch's
        # every linear on the path's native kernel with the other native ops, else on torch's
        self._kernel = (TRITON if self._gpu
                        else kernel_for(dtype, self.device, None if kernels == "native" else kernels)
                        if self._ops is not None else kernel_for_torch(dtype, self.device))
        self._norm = self._make_norm()

        def w(n: str) -> torch.Tensor:
            return tensors[n].to(device=self.device, dtype=dtype)

        def norm_w(n: str) -> torch.Tensor:
            return self._norm_weight(w(n))

        def cat(names: list[str]) -> torch.Tensor | None:
            if names[0] not in tensors:
                return None
            return torch.cat([w(n) for n in names], dim=0).contiguous()

        def qkv(names: list[str]) -> torch.Tensor | None:
            """q|k|v with q's rows scaled by 1/sqrt(head_dim) (attention's scale, folded in once;
            exact when head_dim is a power of 4, as in SmolLM2 / Llama / Qwen2)."""
            t = cat(names)
            if t is not None:
                t[: arch.num_heads * arch.head_dim] *= 1.0 / math.sqrt(arch.head_dim)
            return t

        self._final_norm = norm_w("norm.weight")
        self.draft_vocab = draft_vocab
        self._embed_fn, self._logits_fn = self._make_embed_and_head(
            w("embed_tokens.weight"), None if arch.tie_word_embeddings else w("lm_head.weight"), draft_vocab
        )
        # per layer: (ln1, qkv, o, ln2, gate_up, down), linears packed for 1 and for 2+ rows
        self._layers = []
        for i in range(arch.num_layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            names = [f"{a}{n}_proj.weight" for n in "qkv"]
            self._layers.append(
                (
                    norm_w(f"layers.{i}.input_layernorm.weight"),
                    Linear.pack(qkv(names), qkv([n.replace("weight", "bias") for n in names]), self._kernel),
                    Linear.pack(w(f"{a}o_proj.weight"), w(f"{a}o_proj.bias") if arch.o_bias else None, self._kernel),
                    norm_w(f"layers.{i}.post_attention_layernorm.weight"),
                    Linear.pack(
                        cat([f"{m}gate_proj.weight", f"{m}up_proj.weight"]),
                        cat([f"{m}gate_proj.bias", f"{m}up_proj.bias"]) if arch.mlp_bias else None,
                        self._kernel,
                    ),
                    Linear.pack(w(f"{m}down_proj.weight"), w(f"{m}down_proj.bias") if arch.mlp_bias else None, self._kernel),
                )
            )
        torch_kernels = (ONEDNN_BLOCKED, ATEN_LINEAR, MM)
        off = [lin for layer in self._layers for lin in layer if isinstance(lin, Linear) and lin.kernel in torch_kernels]
        if self._ops is not None and off:  # per op: the rest stays on the native kernels
            log.warning("model %r: %d of its %d linears run on torch's kernels (an input width the native "
                        "kernel's blocks do not divide)", name, len(off), 4 * arch.num_layers)
        if self._ops is not None:
            self._weights_on_huge_pages()
        # each output of every op on one thread (the native kernels): bits whatever the thread count
        self.thread_invariant = (self._ops is not None and not off and self._kernel in NATIVE_KERNELS
                                 and self._head.kernel in NATIVE_KERNELS)
        self._fused = self._fused_layers()
        self._inv_freq, self._rope_scaling = rope_inv_freq(
            arch.rope, arch.head_dim, arch.max_position_embeddings
        )
        self.num_slots, self.max_len = 0, 0
        if max_len is None:
            max_len = min(self.max_context, 2048)
        self.reserve(num_slots, max_len)

    def _weights_on_huge_pages(self) -> None:
        """The native linears' packed weights, copied in the order a forward reads them (per
        layer qkv, o, gate|up, down, then the head) onto huge pages (runners/huge_pages.py): a
        1-token step streams them all, and a stream over 4 KiB pages runs well below the
        memory's bandwidth. The same bytes: every result bit stays."""
        native = [lin for layer in self._layers for lin in layer if isinstance(lin, Linear)
                  and lin.kernel in NATIVE_KERNELS] + ([self._head] if self._head.kernel in NATIVE_KERNELS else [])
        moved = dict(zip(map(id, native), huge_page_copies([lin.weight for lin in native])))

        def move(lin):
            return replace(lin, weight=moved[id(lin)]) if id(lin) in moved else lin

        self._layers = [tuple(move(p) for p in layer) for layer in self._layers]
        self._head = move(self._head)

    def _fused_layers(self) -> tuple[list[torch.Tensor], list[int], int] | None:
        """(params, outs, kernel) of the native `decoder_layers` op, which runs the whole decoder
        stack in one call (kernels/rowinv.cpp), where every linear runs one native kernel; else
        None (the Python loop of `_hidden_native` serves). A bias of 0 elements stands for none."""
        code = {ROWINV: 0, ROWINV512: 1, ROWINV_DP: 2, ROWINV_AMX: 3}
        kinds = {lin.kernel for layer in self._layers for lin in (layer[1], layer[2], layer[4], layer[5])}
        if self._ops is None or len(kinds) != 1 or not kinds <= code.keys():
            return None
        none = torch.empty(0, dtype=self.dtype, device=self.device)
        params: list[torch.Tensor] = []
        outs: list[int] = []
        for ln1, w_qkv, w_o, ln2, w_gu, w_down in self._layers:
            params.append(ln1)
            for lin in (w_qkv, w_o):
                params += [lin.weight, none if lin.bias is None else lin.bias]
            params.append(ln2)
            for lin in (w_gu, w_down):
                params += [lin.weight, none if lin.bias is None else lin.bias]
            outs += [w_qkv.out_features, w_o.out_features, w_gu.out_features, w_down.out_features]
        return params, outs, code[kinds.pop()]

    # ---- cache -----------------------------------------------------------------------------
    def reserve(self, num_slots: int, max_len: int) -> None:
        """Make the cache hold at least (num_slots, max_len); reallocation loses the contents."""
        if max_len > self.max_context:
            window = self.arch.sliding_window
            why = (
                f"sliding-window attention (window {window}) is not supported by the native runner"
                if window is not None and max_len > window
                else f"the model's max_position_embeddings is {self.arch.max_position_embeddings}"
            )
            raise ContextLengthError(
                f"model {self.name!r}: max_len {max_len} > {self.max_context}: {why}"
            )
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"reserve needs num_slots, max_len >= 1, got {num_slots}, {max_len}")
        if num_slots <= self.num_slots and max_len <= self.max_len:
            return
        self.reallocating()  # parked prefix-cache slots are dropped first
        grown = (max(num_slots, self.num_slots), max(max_len, self.max_len))
        # keep what is already larger, unless that would hold over twice the memory asked for
        # (e.g. 100k short rows after a long single one): then allocate exactly the request
        if grown[0] * grown[1] <= 2 * num_slots * max_len:
            num_slots, max_len = grown
        a, dev = self.arch, self.device
        # +1: scratch position; whole key chunks (runners/attention.py)
        shape = (num_slots, a.num_kv_heads, padded_length(max_len + 1), a.head_dim)
        self._k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(a.num_layers)]
        self._v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(a.num_layers)]
        # position-major views (S, P, KV, D) for writing (B, T, KV, D) activations
        self._kw = [c.permute(0, 2, 1, 3) for c in self._k]
        self._vw = [c.permute(0, 2, 1, 3) for c in self._v]
        self._cos, self._sin = rope_tables(  # (max_len + 1, D) each
            self._inv_freq, self._rope_scaling, max_len + 1, torch.float32 if self._ops else self.dtype, dev
        )
        self._arange = torch.arange(shape[2], device=dev)
        self.num_slots, self.max_len = num_slots, max_len  # base rebuilds the free list

    def kv_bytes_per_position(self) -> int:
        a = self.arch
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self._k[0].element_size()

    def move_kv(self, slot: int, start: int, nodes: list[int]) -> None:
        if nodes == list(range(len(nodes))):  # the branch is where it belongs already
            return
        if self._ops is not None and self.device.type == "cpu":  # one native call (kernels/tree.cpp), the same bytes
            self._ops.move_kv(self._k, self._v, slot, start, nodes)
            return
        dst = torch.arange(start, start + len(nodes), device=self.device)
        src = torch.tensor(nodes, dtype=torch.long, device=self.device) + start
        for kc, vc in zip(self._k, self._v):  # (S, KV, P, D) each; the gather reads before it writes
            kc[slot, :, dst] = kc[slot, :, src]
            vc[slot, :, dst] = vc[slot, :, src]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for kc, vc in zip(self._k, self._v):  # (S, KV, P, D) each
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]

    # ---- forward ---------------------------------------------------------------------------
    def _make_embed_and_head(self, embed: torch.Tensor, lm_head: torch.Tensor | None,
                             draft_vocab: list[int] | None = None):
        """(tokens (B, T) -> (B, T, H), hidden (B, G, H) -> logits (B, G, V)), chosen once.
        The head is a `Linear` like the layers' (see runners/linear.py): tied or not, it keeps
        its own (H, V) and blocked copies beside the (V, H) embedding table.

        With `draft_vocab` (a draft model's frequent tokens, see DRAFT_VOCAB_FILE) only those
        rows of the head are computed and every other logit is -inf: a draft that can only
        propose those tokens, at a fraction of the cost (the head is most of a small draft's
        time). Exactness is untouched: the target verifies, and the draft's distribution is
        what it is (zero outside the subset) in the sampling acceptance test too."""
        head = embed if lm_head is None else lm_head  # (V, H)
        V = head.shape[0]

        def embed_fn(tokens: torch.Tensor) -> torch.Tensor:
            return F.embedding(tokens, embed)

        ids = None
        if draft_vocab is not None:
            ids = torch.tensor(sorted(set(draft_vocab)), dtype=torch.long, device=head.device)  # (V',)
            if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= V:
                raise CheckpointError(f"model {self.name!r}: draft vocabulary ids must lie in [0, {V})")
            head = head.index_select(0, ids)  # (V', H)
        self._head = Linear.pack(head, None, self._kernel)  # (huge_page_copies may move its weight)

        def logits_fn(h: torch.Tensor) -> torch.Tensor:
            B, G, H = h.shape
            out = linear(h.reshape(B * G, H), self._head)  # (N, V) or (N, V')
            if ids is not None:  # the draft's subset: -inf elsewhere
                full = torch.full((B * G, V), float("-inf"), dtype=out.dtype, device=out.device)
                out = full.index_copy_(1, ids, out)
            return out.view(B, G, V)

        return embed_fn, logits_fn

    def _make_norm(self):
        """RMSNorm over the last dim, chosen once for the dtype, in few kernels:
        x * rsqrt(mean(x^2) + eps) * w == x / hypot(||x||, sqrt(H * eps)) * (w * sqrt(H)).
        (`F.rms_norm` is ~10 us of CPU per call here, these four kernels ~5 us.) The weights
        are stored pre-scaled by sqrt(H) (see `_norm_weight`) except in bfloat16, which follows
        transformers: normalize in float32, cast back, then multiply by the bfloat16 weight."""
        H, eps = self.arch.hidden_size, self.arch.rms_norm_eps
        vector_norm, hypot = torch.linalg.vector_norm, torch.hypot
        if self._gpu:
            from specrouter.models.runners.triton.forward import make_norm

            return make_norm(eps)
        if self._ops is not None:
            rms_norm = self._ops.rms_norm

            def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return rms_norm(x.reshape(-1, H), weight, eps).view(x.shape)  # (.., H)

        elif self.dtype == torch.bfloat16:
            c = torch.tensor(math.sqrt(H * eps), dtype=torch.float32, device=self.device)
            inv_sqrt_h = 1.0 / math.sqrt(H)

            def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                rms = hypot(vector_norm(x, 2, -1, True, dtype=torch.float32), c).mul_(inv_sqrt_h)
                return torch.div(x, rms).to(x.dtype) * weight  # (.., H) float32 -> bfloat16

        else:
            c = torch.tensor(math.sqrt(H * eps), dtype=self.dtype, device=self.device)

            def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return x / hypot(vector_norm(x, 2, -1, True), c) * weight

        return norm

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """How `norm` wants its weight: times sqrt(H) in torch's float32/float64, else as is."""
        if self.dtype == torch.bfloat16 or self._ops is not None or self._gpu:
            return weight
        return weight * math.sqrt(self.arch.hidden_size)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        B, T = batch.tokens.shape
        x, valid = self._hidden(batch)
        return self._logits(batch, x, valid, B, T)

    @torch.inference_mode()
    def forward_with_features(
        self, batch: ForwardBatch, inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the target features a feature-level draft head (heads/) reads:
        (logits (B, G, vocab) as `forward` returns them, features (B, T, H)), features being
        the last decoder layer's output at EVERY new token, before the final norm, in the
        runner's dtype (padding positions of a ragged batch hold garbage).

        Pre-norm is the residual stream itself; the normed one (the LM head's input) is
        `final_norm(features)`, the same op the logits went through. The features of a position
        are bitwise the same whatever the row count and grouping of the forward, like the
        logits (tests/test_head_features.py). `forward` pays nothing for this method.

        `inputs` (B*T, H), in the runner's dtype, replaces the token embeddings as the first
        layer's input (a feature-level draft head feeds its fused [feature, token] input so)."""
        batch = batch.to(self.device)
        B, T = batch.tokens.shape
        x, valid = self._hidden(batch, inputs)  # (N, H)
        logits = self._logits(batch, x, valid, B, T)
        if valid is not None:  # packed rows back to their (B, T) places; padding stays zero
            x = x.new_zeros(B * T, x.shape[1]).index_copy_(0, valid, x)
        return logits, x.view(B, T, self.arch.hidden_size)

    def final_norm(self, features: torch.Tensor) -> torch.Tensor:
        """(.., H) pre-norm features -> the final RMSNorm's output (the LM head's input), with
        the op the runner's logits use."""
        return self._norm(features, self._final_norm)

    def _hidden(
        self, batch: ForwardBatch, inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack: (x (N, H) after the last layer, before the final norm, valid);
        its input the token embeddings, or `inputs` (B*T, H). N = B*T and valid None, except
        for a ragged batch on the native kernels: x holds its valid tokens only, packed, and
        valid (N,) their flat indices into B*T."""
        a = self.arch
        B, T = batch.tokens.shape
        nh, nkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        groups = nh // nkv
        starts, nums, slots = batch.starts_list, batch.num_tokens_list, batch.slots_list
        L = max(s + n for s, n in zip(starts, nums))  # keys attended: [0, L)
        if L > self.max_len:
            raise ContextLengthError(
                f"model {self.name!r}: a row reaches position {L} > max_len {self.max_len}: "
                "reserve() a longer cache"
            )
        if self._ops is not None:  # the native kernels index slots and positions themselves
            return self._hidden_native(batch, B, T, nh, D, inputs)
        if self._gpu:  # the batch-invariant Triton kernels, tensor-driven (CUDA-graph safe)
            if batch.parents is not None:
                raise NotImplementedError(f"model {self.name!r}: token trees do not run on the GPU path")
            from specrouter.models.runners.triton.forward import hidden

            return hidden(self, batch, inputs)
        s0 = slots[0]
        contiguous = slots == list(range(s0, s0 + B))
        start = starts[0]
        uniform = (contiguous and all(s == start for s in starts) and all(n == T for n in nums)
                   and batch.parents is None)
        norm, H, inter, slots_t = self._norm, a.hidden_size, a.intermediate_size, batch.slots
        ar = self._arange
        Lp = padded_length(L)  # keys attended, in whole chunks: [0, Lp), masked past each query
        if uniform:  # one start, no padding, slots s0..s0+B-1: pure slices, no index tensors
            cos, sin = self._cos[start : start + T, None], self._sin[start : start + T, None]  # (T,1,D)
            mask = ar[:Lp] <= (start + ar[:T]).repeat(groups)[:, None]  # (groups*T, Lp): g*T+t
        else:
            # (B, T): cache position of every new token; padding goes to the scratch row
            pos = batch.starts[:, None] + ar[:T]
            pos = torch.where(ar[:T] < batch.num_tokens[:, None], pos, self.max_len)
            cos, sin = self._cos[pos].unsqueeze(2), self._sin[pos].unsqueeze(2)  # (B, T, 1, D)
            slot_idx = batch.slots[:, None].expand(B, T)
            mask = (ar[:Lp] <= pos.repeat(1, groups)[..., None]).unsqueeze(1)  # (B, 1, groups*T, Lp)
        tree = None
        if batch.parents is not None:  # each node attends its own keys (tree_keys): its own GEMMs
            tree = tree_keys(batch, self.max_len, Lp)
            pos, kidx, mask = tree  # (B, T) RoPE positions, (B*T, Lp) key positions, (B*T, 1, groups, Lp)
            cos, sin = self._cos[pos].unsqueeze(2), self._sin[pos].unsqueeze(2)  # (B, T, 1, D)
            pos = torch.where(ar[:T] < batch.num_tokens[:, None], batch.starts[:, None] + ar[:T], self.max_len)
            mask = mask.expand(B * T, 1, groups, Lp)
            kslot = batch.slots.repeat_interleave(T)[:, None]  # (B*T, 1)
        blocked = blocked_keys(mask)  # once per forward, not per layer

        # (N, H), N = B*T: 2-D so linears are one mm
        x = self._embed_fn(batch.tokens).view(B * T, H) if inputs is None else inputs
        for (ln1, w_qkv, w_o, ln2, w_gu, w_down), kc, vc, kw, vw in zip(
            self._layers, self._k, self._v, self._kw, self._vw
        ):
            qkv = linear(norm(x, ln1), w_qkv).view(B, T, nh + 2 * nkv, D)
            qk = apply_rope(qkv[:, :, : nh + nkv], cos, sin)  # (B, T, nh + nkv, D)
            k, v = qk[:, :, nh:], qkv[:, :, nh + nkv :]  # (B, T, nkv, D)
            if uniform:
                kw.narrow(0, s0, B).narrow(1, start, T).copy_(k)
                vw.narrow(0, s0, B).narrow(1, start, T).copy_(v)
            else:
                kw.index_put_((slot_idx, pos), k)
                vw.index_put_((slot_idx, pos), v)
            if tree is not None:  # per node (B*T, nkv, Lp, D): the prefix, then its ancestors
                keys = kw[kslot, kidx].permute(0, 2, 1, 3).contiguous()
                values = vw[kslot, kidx].permute(0, 2, 1, 3).contiguous()
                q = qk[:, :, :nh].reshape(B * T, nkv, groups, D)  # head h = kv * groups + g
                o = attention(q, keys, values, blocked).reshape(B * T, nh * D)  # (B*T, nkv, groups, D)
                x = linear_add(x, o, w_o)
                gu = linear(norm(x, ln2), w_gu)  # (N, 2I)
                x = linear_add(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down)
                continue
            if contiguous:
                keys, values = kc.narrow(0, s0, B).narrow(2, 0, Lp), vc.narrow(0, s0, B).narrow(2, 0, Lp)
            else:
                keys = kc.narrow(2, 0, Lp).index_select(0, slots_t)  # copies only [0, Lp)
                values = vc.narrow(2, 0, Lp).index_select(0, slots_t)
            # keys, values: (B, nkv, L, D). GQA without copying KV: the `groups` query heads of
            # one KV head become its rows, (B, nkv, groups*T, D), row g*T+t
            q = qk[:, :, :nh].view(B, T, nkv, groups, D).permute(0, 2, 3, 1, 4)
            q = q.reshape(B, nkv, groups * T, D)  # a view when T == 1
            o = attention(q, keys, values, blocked)  # (B, nkv, groups*T, D), row-invariant
            o = o.view(B, nkv, groups, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, nh * D)
            x = linear_add(x, o, w_o)  # residual fused into the matmul
            gu = linear(norm(x, ln2), w_gu)  # (N, 2I)
            x = linear_add(x, F.silu(gu[:, :inter]) * gu[:, inter:], w_down)
        return x, None

    def _hidden_native(
        self, batch: ForwardBatch, B: int, T: int, nh: int, D: int, inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack on the native kernels (kernels/rowinv.cpp): per layer one norm, the qkv
        linear, RoPE + cache write + attention in one op, the o linear with the residual, one
        norm, the gate|up linear, silu * up in one op, the down linear with the residual.

        A ragged batch runs its linears, norms and activations on its valid tokens only, packed
        (N = sum of num_tokens rows, not B*T): a row's result does not depend on the rows beside
        it (the kernels are row-invariant), so packing changes no bit, and a step where one row
        verifies 5 tokens beside 7 plain rows costs 12 rows, not 40. Only attention sees the
        padded (B, T) layout: its input is scattered there and its output gathered back."""
        ops, norm, H = self._ops, self._norm, self.arch.hidden_size
        rope_attention, silu_mul = ops.rope_attention, ops.silu_mul
        cos, sin, slots, starts, nums = self._cos, self._sin, batch.slots, batch.starts, batch.num_tokens
        valid = None  # (N,) int64 flat indices into B*T of the valid tokens, when ragged
        if sum(batch.num_tokens_list) < B * T:
            valid = torch.nonzero((self._arange[:T] < nums[:, None]).view(-1)).flatten()
            if inputs is None:
                x = self._embed_fn(batch.tokens.view(-1).index_select(0, valid))  # (N, H)
            else:
                x = inputs.index_select(0, valid)  # (N, H)
        else:
            x = self._embed_fn(batch.tokens).view(B * T, H) if inputs is None else inputs  # (N, H)
        if self._fused is not None and FUSED_STACK:  # the loop below in one native call: the same bits
            params, outs, kernel = self._fused
            x = ops.decoder_layers(x, params, outs, kernel, self._k, self._v, B, T, nh, D, self.arch.rms_norm_eps,
                                   cos, sin, slots, starts, nums, valid, batch.parents)
            return x, valid  # (N, H)
        for (ln1, w_qkv, w_o, ln2, w_gu, w_down), kc, vc in zip(self._layers, self._k, self._v):
            qkv = linear(norm(x, ln1), w_qkv)  # (N, (nh + 2 nkv) D)
            if valid is not None:  # padding tokens: zeros, neither written nor attended
                qkv = qkv.new_zeros(B * T, qkv.shape[1]).index_copy_(0, valid, qkv)
            o = rope_attention(qkv.view(B, T, -1, D), nh, cos, sin, kc, vc, slots, starts, nums,
                               batch.parents)  # (B, T, nh, D)
            o = o.view(B * T, nh * D)
            if valid is not None:
                o = o.index_select(0, valid)  # (N, nh D)
            x = linear_add(x, o, w_o)
            x = linear_add(x, silu_mul(linear(norm(x, ln2), w_gu)), w_down)  # (N, 2I) -> (N, I)
        return x, valid  # (N, H)

    def _logits(
        self, batch: ForwardBatch, x: torch.Tensor, valid: torch.Tensor | None, B: int, T: int
    ) -> torch.Tensor:
        """x (N, H) after the last layer -> logits (B, G, vocab) at the asked positions; x packed
        when valid is not None (`_hidden`)."""
        H = self.arch.hidden_size
        if valid is not None:  # row b's token i is packed row offset[b] + i
            nums = batch.num_tokens
            offsets = torch.cumsum(nums, 0) - nums  # (B,)
            G = batch.logit_positions.shape[1]
            rows = (offsets[:, None] + batch.logit_positions).view(-1)  # (B*G,), padding repeats
            wanted, where = torch.unique(rows, return_inverse=True)  # the head runs once per position
            normed = self._norm(x.index_select(0, wanted)[None], self._final_norm)  # (1, U, H)
            logits = self._logits_fn(normed)[0]  # (U, vocab)
            return logits.index_select(0, where).view(B, G, -1).to(self._logits_dtype)
        # logits only where asked: gather BEFORE the final norm and the (wide) lm_head
        norm, G = self._norm, batch.logit_positions.shape[1]
        x = x.view(B, T, H)
        if T > 1:
            x = torch.gather(x, 1, batch.logit_positions[:, :, None].expand(B, G, H))  # (B, G, H)
        logits = self._logits_fn(norm(x, self._final_norm))  # (B, G, vocab)
        return logits.to(self._logits_dtype)


def tree_keys(batch: ForwardBatch, scratch: int, Lp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token tree on torch's kernels: (RoPE positions (B, T): start + depth, padding at the
    `scratch` position; key positions (B*T, Lp): [0, start), then the node's ancestors and
    itself as cached (start + index), in depth order; mask (B*T, 1, 1, Lp): True where the node
    attends). Each node then attends its own gathered keys, the keys of sequential decoding
    of its path in the order it reads them."""
    B, T = batch.tokens.shape
    parents, starts, nums = batch.parents.tolist(), batch.starts_list, batch.num_tokens_list
    pos = [[scratch] * T for _ in range(B)]
    kidx = torch.zeros(B * T, Lp, dtype=torch.long)
    depth_of = torch.zeros(B * T, dtype=torch.long)
    for b in range(B):
        paths: list[list[int]] = []
        for t in range(nums[b]):
            par = parents[b][t]
            if not -1 <= par < t:
                raise ValueError(f"row {b} token {t}: parent {par} is not an earlier token")
            path = (paths[par] if par >= 0 else []) + [t]
            paths.append(path)
            s = starts[b]
            pos[b][t] = s + len(path) - 1
            depth_of[b * T + t] = s + len(path) - 1
            kidx[b * T + t, :s] = torch.arange(s)
            kidx[b * T + t, s : s + len(path)] = torch.tensor(path) + s
    dev = batch.tokens.device
    mask = torch.arange(Lp)[None, :] <= depth_of[:, None]  # (B*T, Lp); padding tokens: key 0
    return (torch.tensor(pos, dtype=torch.long, device=dev), kidx.to(dev), mask[:, None, None, :].to(dev))


def _check_gpu_path(dtype: torch.dtype, device: torch.device) -> None:
    """The GPU path runs float32 / bfloat16 on Triton; anything else cannot be exact there."""
    from specrouter.models.runners.triton import interpreting, triton_available

    if not triton_available():
        raise DeviceError(f"the runner on {device} needs Triton for its batch-invariant kernels "
                          "(pip install triton; it ships with PyTorch's CUDA wheels)")
    if dtype not in (torch.float32, torch.bfloat16):
        raise DeviceError(f"{dtype} on {device}: the batch-invariant GPU kernels run float32 and "
                          "bfloat16 only (exact greedy decoding needs them); use --dtype float32")
    if device.type == "cpu" and not interpreting():
        raise DeviceError("kernels='triton' on the CPU needs Triton's interpreter: TRITON_INTERPRET=1")


def load_llama_runner(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    num_slots: int = 1,
    max_len: int | None = None,
    device: torch.device | str = "cpu",
    kernels: str = "native",
) -> LlamaRunner:
    """Load a Llama / SmolLM / Qwen2 / Mistral Hugging Face checkpoint directory (config.json +
    safetensors, sharded or not, tied or untied embeddings) into a LlamaRunner.

    `max_len` defaults to min(max_context, 2048); `name` to the directory name. Raises
    CheckpointError for a missing, broken or unsupported checkpoint, and for a sliding-window
    model asked for a max_len beyond its window."""
    _config, arch, tensors = read_checkpoint(path)
    if max_len is not None and arch.sliding_window is not None and max_len > arch.sliding_window:
        raise CheckpointError(
            f"{str(path)!r} uses sliding-window attention (window {arch.sliding_window}), which the "
            f"native runner does not support: pass max_len <= {arch.sliding_window}"
        )
    if max_len is not None and max_len > arch.max_context:
        raise ContextLengthError(
            f"max_len {max_len} exceeds the model's context of {arch.max_context} positions"
        )
    vocab_file = Path(path) / DRAFT_VOCAB_FILE
    draft_vocab = None
    if vocab_file.is_file():
        try:
            draft_vocab = [int(i) for i in json.loads(vocab_file.read_text())["token_ids"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{vocab_file} is not a draft vocabulary file: {e}") from e
    return LlamaRunner(
        arch,
        tensors,
        draft_vocab=draft_vocab,
        name=name or Path(path).resolve().name,
        dtype=dtype,
        num_slots=num_slots,
        max_len=max_len,
        device=device,
        kernels=kernels,
    )
