"""Rotary position embeddings (default, linear, Llama-3 and YaRN scaling), HF-exact."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers.backend import TORCH_BACKEND, KernelBackend


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, (head_dim // 2,) float32, following HF's formulas bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, scaling)
    assert kind == "llama3", kind
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (so every attention score by its square); 1 otherwise.

    The config's own `attention_factor`, else from `factor` (and DeepSeek's `mscale` /
    `mscale_all_dim` pair): 0.1 ln(s) + 1 per the YaRN paper, for s > 1."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def magnitude(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(magnitude(float(mscale)) / magnitude(float(mscale_all_dim)))
    return magnitude(1.0)


def _yarn_inv_freq(head_dim: int, theta: float, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): dimensions that turn many times over the original context keep their
    frequency, those that turn less than once are interpolated by `factor`, and a linear ramp
    blends the ones between (`beta_fast` / `beta_slow` rotations bound the ramp)."""
    old_len = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
    powers = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key from a precomputed cos/sin table indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        backend: KernelBackend = TORCH_BACKEND,
    ) -> None:
        super().__init__()
        self.backend = backend
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(scaling)  # YaRN's: in the tables, so every backend applies it
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        self.max_positions = max_positions
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim)."""
        return self.backend.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
