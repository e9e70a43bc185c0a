"""The Triton KV store against the reference: slots through shuffled blocks, padding skipped."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.store_kv import store_kv
from tests.kernels.devices import CUDA, DEVICE

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "dim", "block_size"), [(1, 64, 16), (2, 128, 32), (3, 64, 16)])
def test_store_matches_reference_from_strided_qkv_rows(
    dtype: torch.dtype, kv_heads: int, dim: int, block_size: int
) -> None:
    num_tokens, num_blocks = 70, 12
    # key and value as column slices of one fused projection: rows are strided, not contiguous
    qkv = torch.randn(num_tokens, (4 + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    key = qkv[:, 4 * dim : (4 + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    value = qkv[:, (4 + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    perm = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(dim))
    slots = perm[:num_tokens].to(DEVICE)
    slots[[3, 40, 69]] = -1  # padding tokens
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(4)
    ]
    store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == num_tokens - 3


def test_store_reaches_slots_past_32_bit_offsets() -> None:
    block_size, kv_heads, dim = 16, 1, 64
    first = (1 << 21) + 5  # block stride 1024 elements: offsets past 2**31
    k_cache = torch.empty(first + 2, block_size, kv_heads, dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    key = torch.randn(20, kv_heads, dim, device=DEVICE).half()
    slots = torch.arange(first * block_size + 3, first * block_size + 23, device=DEVICE)
    store_kv(key, key * 2, k_cache, v_cache, slots)
    got = k_cache.view(-1, kv_heads, dim)[slots]
    assert torch.equal(got, key) and torch.equal(v_cache.view(-1, kv_heads, dim)[slots], key * 2)


def test_launcher_rejects_bad_arguments() -> None:
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    key = torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.arange(5, device=DEVICE)
    with pytest.raises(ValueError, match="key must have shape"):
        store_kv(key[:, :1], key[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        store_kv(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        store_kv(key, key, cache, cache.clone(), slots[:4])
    with pytest.raises(ValueError, match="share dtype"):
        store_kv(key, key, cache, cache.half(), slots)
