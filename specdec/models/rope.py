"""Rotary position embeddings with the `rope_scaling` variants Llama 3.1 and Qwen ship."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either the old (`rope_theta`, `rope_scaling`) or the new
    (`rope_parameters`) config layout."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = kind
    return theta, scaling


def inverse_frequencies(
    head_dim: int, hf: dict[str, Any]
) -> tuple[torch.Tensor, float]:  # ([head_dim // 2] float32, attention scaling)
    theta, s = rope_parameters(hf)
    dim = int(head_dim * float(hf.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = s["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, s), 1.0
    if kind == "yarn":
        return _yarn(inv, dim, theta, s, hf)
    if kind == "dynamic":
        # Dynamic NTK only changes frequencies beyond the trained length; within it, default.
        return inv, 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     "(supported: default, linear, llama3, yarn, dynamic)")


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv: torch.Tensor, dim: int, theta: float, s: dict[str, Any],
          hf: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_len = float(s.get("original_max_position_embeddings")
                    or hf.get("max_position_embeddings", 4096))
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))
    mscale = float(s.get("attention_factor") or (0.1 * math.log(factor) + 1.0))

    def correction_dim(rot: float) -> float:
        return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, mscale


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embeddings (the half-split layout of HF checkpoints) by position."""

    def __init__(self, head_dim: int, hf: dict[str, Any]) -> None:
        super().__init__()
        inv, self.attention_scaling = inverse_frequencies(head_dim, hf)
        self.rot_dim = inv.numel() * 2
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, signed sin), each [T, 1, rot]; the sin's first half is negated so that
        rotate_half(x) * sin == roll(x, rot / 2) * signed sin, one op instead of four."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rot/2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by cos_sin's (cos, signed sin) over its first rot dims."""
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return torch.addcmul(x * cos, x.roll(rot // 2, -1), sin)
        xr, xp = x[..., :rot], x[..., rot:]  # [T, H, rot], [T, H, D - rot]
        out = torch.addcmul(xr * cos, xr.roll(rot // 2, -1), sin)
        return torch.cat([out, xp], dim=-1)
