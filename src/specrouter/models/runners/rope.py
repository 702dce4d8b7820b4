"""Rotary position embeddings (RoPE) for the native runner: config parsing, inverse frequencies
of the scaling variants, precomputed cos/sin tables and their application.

The inverse frequencies are computed with the same float32 expressions as transformers'
`modeling_rope_utils.py` (so a checkpoint gets the very frequencies it was trained with); the
angles `position * inv_freq` and their cos/sin are then computed in float64 and cast to the
compute dtype once, at table-build time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specrouter.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters_from_config(config: dict[str, Any]) -> dict[str, Any]:
    """Normalize a config.json's RoPE settings into one flat dict with `rope_type` and
    `rope_theta` (plus the variant's own keys).

    Reads both conventions: transformers >= 5 (`rope_parameters` holding `rope_theta` and
    `rope_type`) and the older one (top-level `rope_theta`, optional `rope_scaling` with `type`
    or `rope_type`). Raises CheckpointError for unknown variants and partial rotary factors."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise CheckpointError("per-layer-type RoPE parameters are not supported (native runner)")
    rope_type = params.pop("type", "default")
    rope_type = params.get("rope_type", rope_type)
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", config.get("rope_theta") or 10_000.0)
    params["rope_theta"] = float(params["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported RoPE type {rope_type!r}: the native runner supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise CheckpointError(f"partial_rotary_factor={partial} is not supported (native runner)")
    if rope_type in ("llama3", "yarn"):
        # like transformers: a top-level original_max_position_embeddings wins
        omax = config.get("original_max_position_embeddings")
        if omax is not None:
            params["original_max_position_embeddings"] = omax
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    required = {"linear": ("factor",), "dynamic": ("factor",)}
    required["llama3"] = ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in required.get(rope_type, ()) if params.get(k) is None]
    if missing:
        raise CheckpointError(f"RoPE type {rope_type!r} needs {missing} in the config")
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # (dim/2,) float32, exactly transformers' default expression
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def rope_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) float32 and the attention scaling applied to cos/sin.

    `dynamic` (NTK) only changes the frequencies past `max_position_embeddings`, which a runner
    never reaches (its max_len <= max_context), so inside the runner it equals `default`."""
    rope_type, base, dim = params["rope_type"], params["rope_theta"], head_dim
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "llama3":
        inv_freq = _base_inv_freq(base, dim)
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, dim, base, max_position_embeddings)
    raise CheckpointError(f"unsupported RoPE type {rope_type!r}")


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, base: float, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    omax = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / omax
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(omax / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_tables(
    inv_freq: torch.Tensor,
    attention_scaling: float,
    num_positions: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables, each (num_positions, head_dim), for `apply_rope`.

    `sin_signed = [-sin, sin]` folds rotate_half's negation into the table: a rotation is
    `x * cos + [x2, x1] * sin_signed`, the same products as transformers' rotate_half."""
    pos = torch.arange(num_positions, dtype=torch.float64)
    freqs = pos[:, None] * inv_freq.to(torch.float64)[None, :]  # (P, D/2)
    cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
    cos = torch.cat((cos, cos), dim=-1)  # (P, D)
    sin_signed = torch.cat((-sin, sin), dim=-1)  # (P, D)
    return cos.to(device=device, dtype=dtype), sin_signed.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (..., head_dim) by tables broadcastable to it (see `rope_tables`):
    x * cos + [x2, x1] * [-sin, sin], with [x2, x1] one flip of the two halves."""
    halves_swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, halves_swapped, sin_signed)
