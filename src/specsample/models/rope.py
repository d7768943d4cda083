"""Rotary position embedding frequencies for the variants Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def rope_inv_freq(config: Any) -> tuple[Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` and the attention scaling of the RoPE variant of `config` (a
    `LlamaConfig`: head_dim, rope_theta, rope_scaling, max_position_embeddings)."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")  # never on meta, even at init
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    if config.rope_scaling is None:
        return inv_freq, 1.0
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, factor), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(config, scaling, factor)
    raise ValueError(f"RoPE scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any], factor: float) -> Tensor:
    low_factor = float(scaling["low_freq_factor"])
    high_factor = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low_factor, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_factor) & (wavelen <= old_len / low_factor)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(config: Any, scaling: dict[str, Any], factor: float) -> tuple[Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    old_len = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    attention_factor = scaling.get("attention_factor") or 0.1 * math.log(factor) + 1.0
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low: float = math.floor(correction_dim(beta_fast))
    high: float = math.ceil(correction_dim(beta_slow))
    if scaling.get("truncate", True) is False:
        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_tables(inv_freq: Tensor, scale: float, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE cos and sin `[b, n, 1, hd]` in `dtype` for `positions [b, n]` (`inv_freq` on the positions' device)."""
    angles = positions.unsqueeze(-1).float() * inv_freq  # [b, n, hd/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [b, n, 1, hd]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
