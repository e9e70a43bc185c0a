"""Sizing the paged KV pool: bytes per block, the memory budget, and how many blocks fit it.

The engine (ModelRunner) and `python -m engine plan` (planner.py) size it with these same
functions, so a plan is what the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.layers import kv_cache
from engine.models.config import ModelConfig

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB


@dataclass(frozen=True)
class KVCacheLayout:
    """Derived sizes of the KV pool (kept apart from the frozen config)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_token_slots(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size


def gpu_kv_budget(total: int, free: int, utilization: float, activation_peak: int) -> int:
    """Bytes left for the KV pool: the allowed share of the device, less what is already in use
    (weights, CUDA context, other processes: total - free) and the profiled activation peak."""
    return int(total * utilization) - (total - free) - activation_peak


def kv_bytes_per_block(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    tensor_parallel_size: int = 1,
) -> int:
    """Bytes one KV block takes on one rank, every layer's K and V (and scales when quantized): the
    seeds' 2 x layers x kv_heads x head_dim x tokens x bytes. The engine's sizing and
    `python -m engine plan` both use it."""
    heads = kv_cache.kv_heads_per_rank(model_config.num_kv_heads, tensor_parallel_size)
    per_token = kv_cache.bytes_per_token(heads, model_config.head_dim, dtype, kv_cache_dtype)
    return model_config.num_layers * block_size * per_token


@dataclass(frozen=True)
class KVCompanion:
    """A model that shares the GPU's budget with the engine's KV pool: a speculative draft model,
    loaded after the pool is sized, whose weights and KV (as many tokens as the pool's) come out of
    the same memory."""

    weight_bytes: int
    bytes_per_token: int  # its KV, every layer


def plan_kv_cache(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    activation_peak: int = 0,
    companion: KVCompanion | None = None,
) -> KVCacheLayout:
    """Number of blocks that fit the memory budget: kv_cache_memory bytes when set, else 1 GiB on
    CPU, else on GPU `gpu_memory_utilization` of the device less weights and the activation peak
    (and a `companion`'s weights, its KV growing with the pool's). A quantized pool (kv_cache_dtype
    int8/fp8) costs its codes plus a scale per token and head."""
    per_block = kv_bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype)
    shared = per_block  # what one more block costs, the companion's KV included
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(total, free, config.gpu_memory_utilization, activation_peak)
        if companion is not None:
            budget -= companion.weight_bytes
            shared += companion.bytes_per_token * config.block_size
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = max(budget, 0) // shared
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no KV block ({per_block} bytes per block of "
            f"{config.block_size} tokens): give it more memory"
        )
    return KVCacheLayout(num_blocks=num_blocks, block_size=config.block_size, bytes_per_block=per_block)
