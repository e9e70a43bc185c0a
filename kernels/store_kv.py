"""Store new tokens' K and V into the paged KV cache through a slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.checks import KV_CACHE_DTYPES, check_device, check_shape, check_tensor, interpreting
from kernels.paged_attention import FP8_E4M3, kv_scale_args


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


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| <= 448) rounded to nearest-even on the e4m3 grid, so that the cast to fp8
    is exact (Triton's interpreter drops the carry when a rounding crosses a power of two)."""
    bits = y.to(tl.int32, bitcast=True)
    # normal numbers: keep 3 of 23 mantissa bits, ties to even (a carry moves into the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormals (below 2**-6): multiples of 2**-9; adding 1.5 * 2**14 leaves exactly that ulp
    subnormal = tl.abs((y + 24576.0) - 24576.0)
    subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign bit survives, -0.0 included
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_store(
    x, code_ptrs, scale_ptrs, mask, row_ok, FP8: tl.constexpr, CODE_MAX: tl.constexpr, MIN_SCALE: tl.constexpr
):
    """Each row of x (BLOCK_T, BLOCK_D) float32 -> codes and its float16 scale (kernels/kv_quant.py)."""
    amax = tl.max(tl.abs(x), axis=1)
    # correctly rounded divisions, as torch's reference: a GPU's `/` on float32 may be 2 ulp off
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + CODE_MAX)
    scale = tl.maximum(scale.to(tl.float16).to(tl.float32), MIN_SCALE)
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale[:, None])
    y = tl.minimum(tl.maximum(y, -CODE_MAX), CODE_MAX)
    if FP8:
        codes = _round_to_e4m3(y).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        codes = tl.floor(y + 0.5).to(tl.int8)
    tl.store(code_ptrs, codes, mask=mask)
    tl.store(scale_ptrs, scale.to(tl.float16), mask=row_ok)


@triton.jit
def _store_kv_quant_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    CODE_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    # program: BLOCK_T tokens x one KV head; a row's absolute maximum sets its scale
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    row_ok = slots >= 0  # padding tokens carry slot -1
    block = slots // BLOCK_SIZE
    within = slots % BLOCK_SIZE
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    code_off = (block * stride_cb + within * stride_cs + head * stride_ch)[:, None] + offs_d[None, :]
    scale_off = block * stride_sb + within * stride_ss + head
    tok = offs_t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    k_ptrs, k_scale_ptrs = k_cache_ptr + code_off, k_scale_ptr + scale_off
    v_ptrs, v_scale_ptrs = v_cache_ptr + code_off, v_scale_ptr + scale_off
    _quantize_store(k.to(tl.float32), k_ptrs, k_scale_ptrs, mask, row_ok, FP8, CODE_MAX, MIN_SCALE)
    _quantize_store(v.to(tl.float32), v_ptrs, v_scale_ptrs, mask, row_ok, FP8, CODE_MAX, MIN_SCALE)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value (num_tokens, num_kv_heads, head_dim) into slots; slots < 0 are skipped.

    Caches are (num_blocks, block_size, num_kv_heads, head_dim), contiguous in their last two
    dimensions; key and value may be strided views (rows of a fused QKV projection). An int8 or
    fp8 cache stores codes, and each token-head's float16 scale in k_scale / v_scale.
    """
    check_device(key, value, k_cache, v_cache, slot_mapping)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
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
    if kv_quant.is_quantized(k_cache):
        _store_quantized(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    kv_scale_args(k_cache, v_cache, k_scale, v_scale)  # refuses scales for a plain cache
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


def _store_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    kv = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    check_device(key, kv.k_scale, kv.v_scale)
    num_tokens = key.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_t = 64 if interpreting() else 16
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _store_kv_quant_kernel[grid](
        key,
        value,
        kv.k,
        kv.v,
        kv.k_scale,
        kv.v_scale,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kv.stride_sb,
        kv.stride_ss,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=kv.quant == FP8_E4M3,
        CODE_MAX=kv_quant.code_max(k_cache.dtype),
        MIN_SCALE=kv_quant.MIN_SCALE,
    )
