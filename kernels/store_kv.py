"""Store new tokens' K and V into the paged KV cache through a slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_device, check_shape, check_tensor, interpreting


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # program: BLOCK_T tokens x (num_kv_heads * head_dim) elements each
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_HD)  # flattened (head, dim)
    head = offs_e // HEAD_DIM
    dim = offs_e % HEAD_DIM
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    row_ok = slots >= 0  # padding tokens carry slot -1
    # int64 block offsets: block ids times the block stride overflow 32 bits in large pools
    block = slots // BLOCK_SIZE
    within = slots % BLOCK_SIZE
    mask = row_ok[:, None] & (offs_e[None, :] < NUM_KV_HEADS * HEAD_DIM)
    cache_off = block[:, None] * stride_cb + within[:, None] * stride_cs + head[None, :] * stride_ch + dim
    tok = offs_t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value (num_tokens, num_kv_heads, head_dim) into slots; slots < 0 are skipped.

    Caches are (num_blocks, block_size, num_kv_heads, head_dim), contiguous in their last two
    dimensions; key and value may be strided views (rows of a fused QKV projection).
    """
    check_device(key, value, k_cache, v_cache, slot_mapping)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share dtype and strides")
    if k_cache.stride(2) != head_dim:
        raise ValueError(f"k_cache heads must be contiguous rows of head_dim, got strides {k_cache.stride()}")
    num_tokens = key.shape[0]
    check_tensor("key", key, ndim=3)
    check_tensor("value", value, ndim=3)
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    # a GPU program per few tokens; the interpreter pays per program, so it takes many at once
    block_t = 64 if interpreting() else max(1, 2048 // block_hd)
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )
