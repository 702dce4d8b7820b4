"""The EAGLE-1-style draft head: [final_norm(feature_t), embed(token_{t+1})] -> fc (2H -> H) ->
one Llama decoder layer (the target's layer shape, its own weights) -> feature_{t+1}, the
prediction of the target's next feature; its logits are the target's final norm and the
target's LM-head rows of a REDUCED vocabulary (the corpus's most frequent tokens).

Choices (EAGLE-1, Li et al. 2024, with what this project measured):
- features are the target's last decoder layer output BEFORE the final norm (the residual
  stream, what `LlamaRunner.forward_with_features` returns). The head normalises every feature
  it reads with the target's frozen final norm (so the scale of the residual stream, with its
  few huge dimensions, never reaches the fc), and its own output lives in the same pre-norm
  space: a predicted feature is fed back exactly like a target feature. The regression loss
  compares normed features (the LM head's inputs), where every dimension counts for what it
  does to the logits.
- frozen and shared with the target: the token embedding, the final norm, the LM-head rows of
  the reduced vocabulary. Trained: fc and the layer (initialised from the target's LAST layer;
  fc from [I | I], so the first layer input starts as feature + next-token embedding).
- the reduced vocabulary keeps the step cheap: SmolLM2-135M's full head (49152 x 576) alone is
  ~21% of the target's parameters; 8192 rows are 3.5%.

`unrolled` is the differentiable forward over draft depths 1..levels at once (EAGLE-3's
"training-time test"): depth j at position t continues a chain started at s = t - j + 1 from the
true features up to s, feeding its own predicted features for s+1..t (the tokens are the text's:
along an accepted draft they are the drafted ones). Training on depths > 1 teaches the head to
read its own predictions; evaluation reads the acceptance at every depth from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specrouter.errors import CheckpointError
from specrouter.models.runners.llama import LlamaArchitecture
from specrouter.models.runners.rope import apply_rope, rope_inv_freq, rope_tables

HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"
FEATURE_KIND = "last-layer-prenorm"  # what the head reads: LlamaRunner.forward_with_features
# the layer's tensors: checkpoint suffix after "layers.N." (biases only where the target has them)
LAYER_TENSORS = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
)


@dataclass(frozen=True)
class HeadConfig:
    """What a saved head is (head_config.json): the target's config.json it was trained on and
    its reduced vocabulary."""

    target_config: dict  # the target's config.json (architecture; the head's layer has its shape)
    vocab_ids: tuple[int, ...]  # the reduced vocabulary: target token ids, sorted
    feature: str = FEATURE_KIND  # the feature the head reads and predicts

    def __post_init__(self) -> None:
        ids = self.vocab_ids
        V = int(self.target_config["vocab_size"])
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= V:
            raise CheckpointError(f"head vocabulary must be sorted distinct ids in [0, {V})")
        if self.feature != FEATURE_KIND:
            raise CheckpointError(f"head reads {self.feature!r} features; this version reads {FEATURE_KIND!r}")

    @property
    def target_arch(self) -> LlamaArchitecture:
        return LlamaArchitecture.from_config(self.target_config)

    @property
    def layer_arch(self) -> LlamaArchitecture:
        """The target's architecture with one layer: the head's."""
        return replace(self.target_arch, num_layers=1)

    def to_json(self) -> str:
        return json.dumps({"target_config": self.target_config, "vocab_ids": list(self.vocab_ids),
                           "feature": self.feature, "vocab_size": len(self.vocab_ids)})

    @staticmethod
    def from_json(text: str) -> HeadConfig:
        d = json.loads(text)
        return HeadConfig(target_config=d["target_config"], vocab_ids=tuple(int(i) for i in d["vocab_ids"]),
                          feature=d.get("feature", FEATURE_KIND))


def frequent_tokens(tokens: torch.Tensor, vocab: int, size: int, always: tuple[int, ...] = ()) -> list[int]:
    """The `size` most frequent ids of `tokens` (any shape; ties and unseen ids by id, i.e. BPE
    merge order, as distill.train.write_draft_vocab) plus `always`, sorted."""
    count = torch.bincount(tokens.reshape(-1), minlength=vocab)[:vocab].double()
    order = (count * vocab - torch.arange(vocab, dtype=torch.float64)).argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[: min(size, vocab)]] = True
    keep[[i for i in always if 0 <= i < vocab]] = True
    return keep.nonzero()[:, 0].tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(.., H) -> (.., H), in float32 (transformers' LlamaRMSNorm)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class EagleHead(torch.nn.Module):
    """The head's trainable tensors (`params`, checkpoint names) and the target's frozen ones."""

    def __init__(self, config: HeadConfig, target_tensors: dict[str, torch.Tensor],
                 params: dict[str, torch.Tensor] | None = None) -> None:
        """`target_tensors`: the target checkpoint's tensors (runners.llama.read_checkpoint);
        `params`: the head's own (checkpoint names, e.g. "fc.weight", "layers.0.mlp.up_proj.weight"),
        default: fc = [I | I], the layer copied from the target's last layer."""
        super().__init__()
        self.config = config
        arch = self.arch = config.target_arch
        H = arch.hidden_size
        f32 = lambda t: t.detach().to(torch.float32)
        if params is None:
            last = f"layers.{arch.num_layers - 1}."
            params = {"fc.weight": torch.cat([torch.eye(H), torch.eye(H)], 1)}
            params |= {f"layers.0.{n}": target_tensors[last + n] for n in LAYER_TENSORS
                       if last + n in target_tensors}
        expected = {"fc.weight": (H, 2 * H)} | {
            n: s for n, s in replace(arch, num_layers=1).expected_shapes().items() if n.startswith("layers.0.")}
        missing = sorted(set(expected) - set(params))
        if missing or any(tuple(params[n].shape) != s for n, s in expected.items()):
            raise CheckpointError(f"head tensors do not fit the target: missing {missing[:4]}, or misshaped")
        # ParameterDict keys may not hold dots
        self.params = torch.nn.ParameterDict({n.replace(".", "/"): torch.nn.Parameter(f32(params[n]))
                                              for n in expected})
        ids = torch.tensor(config.vocab_ids, dtype=torch.long)
        embed = f32(target_tensors["embed_tokens.weight"])  # (V, H)
        head = embed if arch.tie_word_embeddings else f32(target_tensors["lm_head.weight"])
        self.register_buffer("embed", embed, persistent=False)  # (V, H) frozen
        self.register_buffer("final_norm", f32(target_tensors["norm.weight"]), persistent=False)  # (H,)
        self.register_buffer("vocab_ids", ids, persistent=False)  # (V',)
        self.register_buffer("head_rows", head.index_select(0, ids).contiguous(), persistent=False)  # (V', H)
        where = torch.full((arch.vocab_size,), -1, dtype=torch.long)
        where[ids] = torch.arange(len(ids))
        self.register_buffer("vocab_index", where, persistent=False)  # (V,): reduced index or -1
        inv_freq, scaling = rope_inv_freq(arch.rope, arch.head_dim, arch.max_position_embeddings)
        self._rope = (inv_freq, scaling)

    # ---- tensors ---------------------------------------------------------------------------
    def p(self, name: str) -> torch.Tensor | None:
        """A trainable tensor by checkpoint name, None if absent (a bias the target lacks)."""
        key = name.replace(".", "/")
        return self.params.get(key, None)

    def head_tensors(self) -> dict[str, torch.Tensor]:
        """The trainable tensors by checkpoint name (what HEAD_WEIGHTS_FILE holds)."""
        return {k.replace("/", "."): v.detach() for k, v in self.params.items()}

    # ---- forward ---------------------------------------------------------------------------
    def norm(self, features: torch.Tensor) -> torch.Tensor:
        """Pre-norm features (.., H) -> the target's final norm of them (.., H), float32."""
        return rms_norm(features, self.final_norm, self.arch.rms_norm_eps)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Pre-norm features (.., H) -> logits over the reduced vocabulary (.., V')."""
        return self.norm(features) @ self.head_rows.T

    def _layer_input(self, normed: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """fc([normed feature, embedding of the next token]): (B, n, H), (B, n) -> (B, n, H)."""
        emb = F.embedding(next_tokens, self.embed)  # (B, n, H)
        return torch.cat([normed, emb], -1) @ self.p("fc.weight").T

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer input (B, n, H) -> q (B, nh, n, D), k, v (B, nkv, n, D) after RoPE."""
        a, p = self.arch, self.p
        B, n, _ = x.shape
        h = rms_norm(x, p("layers.0.input_layernorm.weight"), a.rms_norm_eps)
        out = []
        for name, heads in (("q", a.num_heads), ("k", a.num_kv_heads), ("v", a.num_kv_heads)):
            y = F.linear(h, p(f"layers.0.self_attn.{name}_proj.weight"), p(f"layers.0.self_attn.{name}_proj.bias"))
            y = y.view(B, n, heads, a.head_dim)
            out.append((apply_rope(y, cos, sin) if name != "v" else y).transpose(1, 2))
        return out

    def _layer_output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o(attn), then + MLP: (B, n, H), (B, n, nh*D) -> (B, n, H)."""
        a, p = self.arch, self.p
        x = x + F.linear(attn, p("layers.0.self_attn.o_proj.weight"), p("layers.0.self_attn.o_proj.bias"))
        h = rms_norm(x, p("layers.0.post_attention_layernorm.weight"), a.rms_norm_eps)
        gate = F.linear(h, p("layers.0.mlp.gate_proj.weight"), p("layers.0.mlp.gate_proj.bias"))
        up = F.linear(h, p("layers.0.mlp.up_proj.weight"), p("layers.0.mlp.up_proj.bias"))
        return x + F.linear(F.silu(gate) * up, p("layers.0.mlp.down_proj.weight"), p("layers.0.mlp.down_proj.bias"))

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, levels: int = 1,
                 noise: float = 0.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """Predicted features at draft depths 1..levels, each (B, n, H), n = T - 1.

        features (B, T, H): the target's pre-norm features of `tokens` (B, T). out[j-1][:, t] is
        the head's prediction of the feature of position t+1 (whose logits predict token t+2)
        at depth j: its chain starts at s = t-j+1 with the target's features up to s and reads
        its own predictions for positions s+1..t (valid where t >= j-1; out[0] is the plain
        teacher-forced forward). `noise`: std of Gaussian noise added to the normed target
        features (EAGLE's robustness trick), training only."""
        a = self.arch
        B, T, _ = features.shape
        n = T - 1
        cos, sin = rope_tables(*self._rope, n, torch.float32, features.device)
        cos, sin = cos[:, None], sin[:, None]  # (n, 1, D): positions 0..n-1, broadcast over heads
        normed = self.norm(features[:, :n])  # (B, n, H): level-1 inputs
        if noise > 0:
            normed = normed + noise * torch.randn(normed.shape, generator=generator)
        next_tokens = tokens[:, 1:]  # (B, n)
        pos = torch.arange(n, device=features.device)
        back = pos[:, None] - pos[None, :]  # (n, n): t - p
        groups = a.num_heads // a.num_kv_heads
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for j in range(1, levels + 1):
            if j > 1:  # position t reads the prediction made at t-1 (position 0: a filler)
                prev = self.norm(outs[-1])  # (B, n, H)
                normed = torch.cat([prev[:, :1], prev[:, :-1]], 1)
            x = self._layer_input(normed, next_tokens)  # (B, n, H)
            q, k, v = self._qkv(x, cos, sin)
            ks.append(k)
            vs.append(v)
            # key (level l, position p) is what query t of level j saw: p <= t, l = max(1, j - (t - p))
            level = (j - back).clamp(min=1)  # (n, n)
            mask = torch.cat([(back >= 0) & (level == lv) for lv in range(1, j + 1)], 1)  # (n, j*n)
            keys = torch.cat(ks, 2).repeat_interleave(groups, 1)  # (B, nh, j*n, D)
            values = torch.cat(vs, 2).repeat_interleave(groups, 1)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (B, nh, n, D)
            outs.append(self._layer_output(x, o.transpose(1, 2).reshape(B, n, a.num_heads * a.head_dim)))
        return outs


def save_head(out: str | Path, head: EagleHead, dtype: torch.dtype = torch.bfloat16) -> None:
    """OUT/head.safetensors (the trainable tensors in `dtype`) + OUT/head_config.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.to(dtype).contiguous() for n, t in head.head_tensors().items()}
    save_file(tensors, str(out / HEAD_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / HEAD_CONFIG_FILE).write_text(head.config.to_json())


def read_head(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """(config, trainable tensors as stored) of a saved head folder."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg, weights = root / HEAD_CONFIG_FILE, root / HEAD_WEIGHTS_FILE
    if not cfg.is_file() or not weights.is_file():
        raise CheckpointError(f"{str(root)!r} is not a draft head folder (needs {HEAD_CONFIG_FILE} "
                              f"and {HEAD_WEIGHTS_FILE})")
    try:
        return HeadConfig.from_json(cfg.read_text()), load_file(str(weights))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the head in {root}: {e}") from e


def check_target(config: HeadConfig, target_config: dict) -> None:
    """Raise CheckpointError unless the target's architecture is the one the head was trained on."""
    if LlamaArchitecture.from_config(target_config) != config.target_arch:
        raise CheckpointError("the draft head was trained on a target of another architecture")


def load_head(path: str | Path, target: str | Path) -> EagleHead:
    """A saved head (float32, eval mode) on the target checkpoint it was trained for."""
    from specrouter.models.runners.llama import read_checkpoint

    config, params = read_head(path)
    target_config, _arch, tensors = read_checkpoint(target)
    check_target(config, target_config)
    return EagleHead(config, tensors, params).eval()


def param_count(config: HeadConfig) -> dict[str, int]:
    """Parameters a head step touches: trained (fc + layer), and the reduced head rows."""
    a = config.target_arch
    H = a.hidden_size
    layer = sum(math.prod(s) for n, s in replace(a, num_layers=1).expected_shapes().items()
                if n.startswith("layers.0."))
    return {"trained": 2 * H * H + layer, "head_rows": len(config.vocab_ids) * H}
