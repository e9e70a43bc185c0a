"""Rotary position embeddings (default, linear and Llama-3 scaling), HF-exact."""

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
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        self.max_positions = max_positions
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim)."""
        return self.backend.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
