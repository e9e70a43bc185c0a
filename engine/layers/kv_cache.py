"""One layer's paged KV pool: values in the model's dtype, or int8/fp8 codes with their scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import kv_quant


@dataclass(frozen=True)
class LayerKVCache:
    """K and V pools (num_blocks, block_size, num_kv_heads, head_dim); quantized pools carry float16
    scales (num_blocks, block_size, num_kv_heads), one per token and KV head."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the pool lives."""
        return self.k.device


def code_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What a pool stores for `kv_cache_dtype` (engine/config.py's KV_CACHE_DTYPES) under a model
    computing in `dtype`: "auto" stores the model's dtype."""
    if kv_cache_dtype == "auto":
        return dtype
    return kv_quant.KV_CODE_DTYPES[kv_cache_dtype]


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads one rank holds: split across ranks, replicated when there are fewer than ranks."""
    return max(1, num_kv_heads // tensor_parallel_size)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token takes in one layer's K and V pools (codes plus scales when quantized)."""
    stored = code_dtype(kv_cache_dtype, dtype)
    per_head = head_dim * stored.itemsize
    if kv_cache_dtype != "auto":
        per_head += kv_quant.SCALE_DTYPE.itemsize
    return 2 * num_kv_heads * per_head


def allocate(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
) -> LayerKVCache:
    """A zeroed pool of num_blocks blocks for one layer."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    stored = code_dtype(kv_cache_dtype, dtype)
    k = torch.zeros(shape, dtype=stored, device=device)
    v = torch.zeros(shape, dtype=stored, device=device)
    if kv_cache_dtype == "auto":
        return LayerKVCache(k, v)
    scale_shape = shape[:3]
    return LayerKVCache(
        k,
        v,
        torch.ones(scale_shape, dtype=kv_quant.SCALE_DTYPE, device=device),
        torch.ones(scale_shape, dtype=kv_quant.SCALE_DTYPE, device=device),
    )
