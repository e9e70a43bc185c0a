"""Random paged KV caches for kernel tests: each sequence's K/V scattered into shuffled blocks."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kernels import reference


@dataclass
class PagedCache:
    """Caches (num_blocks, block_size, kv_heads, dim), int32 block tables, and each sequence's K/V."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    keys: list[torch.Tensor]  # per sequence (context, kv_heads, dim)
    values: list[torch.Tensor]


def paged_cache(
    contexts: list[int],
    block_size: int,
    kv_heads: int,
    dim: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    first_block: int = 0,
    device: str | torch.device = "cpu",
) -> PagedCache:
    """Blocks are drawn in shuffled order from ids >= first_block; a large first_block puts block
    offsets past 2**31 elements (the pool is allocated but only the used blocks are touched)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // block_size) for c in contexts]
    ids = list(range(first_block, first_block + sum(needed) + 3))
    random.Random(seed).shuffle(ids)
    shape = (max(ids) + 1, block_size, kv_heads, dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    if first_block == 0:  # small pools: defined contents everywhere (padding reads stay finite)
        k_cache.zero_()
        v_cache.zero_()
    tables, keys, values = [], [], []
    for ctx, n in zip(contexts, needed, strict=True):
        table = [ids.pop() for _ in range(n)]
        k = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype=dtype, device=device)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        reference.store_kv(k, v, k_cache, v_cache, slots.to(device))
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    # rows padded with their own first block: a valid id that the lengths keep out of reach
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    block_tables = torch.tensor(padded, dtype=torch.int32, device=device)
    return PagedCache(k_cache, v_cache, block_tables, keys, values)


def past_32_bits(block_size: int, kv_heads: int, dim: int) -> int:
    """A first block id whose offset (id x block stride) is just past 2**31 elements."""
    return (1 << 31) // (block_size * kv_heads * dim) + 5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Float64 causal attention. q: (q_len, H, D); k, v: (ctx, KVH, D); query i sits at q_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    pos_q = torch.arange(q.shape[0], device=q.device)[:, None] + q_offset
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
