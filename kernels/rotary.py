"""NeoX/HF rotate-half rotary embedding of q and k in Triton (twin: reference.rotary_embedding).

Each product and the sum are rounded to q's dtype in the reference's order, so fp16/bf16 results
match the torch path bit for bit (float32 may differ in the last bit where the GPU compiler fuses
a multiply-add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_device, check_shape, check_tensor, interpreting

_MAX_TILE = 4096  # elements of one half-head tile per program on GPU
_MAX_TILE_INTERPRET = 1 << 16  # the interpreter pays per program, not per element


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    offs_t,
    mask_t,
    c1,
    c2,
    s1,
    s2,
    num_heads,
    half,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # tiles are (BLOCK_T, BLOCK_H, BLOCK_HALF); c*, s* are (BLOCK_T, 1, BLOCK_HALF) float32 values
    # already rounded to x's dtype; offs_t is int64
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = mask_t[:, None, None] & (offs_h < num_heads)[None, :, None] & (offs_d < half)[None, None, :]
    x_offs = offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * stride_xh + offs_d[None, None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each step rounded like torch's
    o1 = ((x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    o_offs = offs_t[:, None, None] * stride_ot + offs_h[None, :, None] * stride_oh + offs_d[None, None, :]
    tl.store(out_ptr + o_offs, o1, mask=mask)
    tl.store(out_ptr + o_offs + half, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    num_heads,
    num_kv_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # one program: BLOCK_T tokens, all their q and k heads; the cos/sin rows are loaded once
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < num_tokens
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)  # (BLOCK_T,)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_c = mask_t[:, None] & (offs_d < half)[None, :]
    cos_offs = pos[:, None] * stride_cos + offs_d[None, :]  # (BLOCK_T, BLOCK_HALF)
    sin_offs = pos[:, None] * stride_sin + offs_d[None, :]
    dtype = q_ptr.dtype.element_ty
    # the tables are cast to q's dtype before the multiply, as the reference does
    c1 = tl.load(cos_ptr + cos_offs, mask=mask_c, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_ptr + cos_offs + half, mask=mask_c, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    s1 = tl.load(sin_ptr + sin_offs, mask=mask_c, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    s2 = tl.load(sin_ptr + sin_offs + half, mask=mask_c, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, offs_t, mask_t, c1, c2, s1, s2, num_heads, half,
        stride_qt, stride_qh, stride_qot, stride_qoh, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, offs_t, mask_t, c1, c2, s1, s2, num_kv_heads, half,
        stride_kt, stride_kh, stride_kot, stride_koh, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def _check(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    check_device(positions, q, k, cos_cache, sin_cache)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotate_half splits it), got {head_dim}")
    check_shape("positions", positions, (num_tokens,))
    check_shape("k", k, (num_tokens, k.shape[1], head_dim))
    check_tensor("cos_cache", cos_cache, ndim=2, dtypes=FLOAT_DTYPES)
    check_shape("cos_cache", cos_cache, (cos_cache.shape[0], head_dim))
    check_tensor("sin_cache", sin_cache, ndim=2, dtypes=(cos_cache.dtype,))
    check_shape("sin_cache", sin_cache, tuple(cos_cache.shape))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k at `positions`; new contiguous tensors, or q and k themselves if inplace.

    positions: (num_tokens,) int32/int64, each < max_positions (not checked: it would synchronise);
    q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim), same dtype, any
    strides but a unit last one (e.g. views of a fused qkv); cos_cache, sin_cache: (max_positions,
    head_dim) as built by engine.layers.rotary (cat(freqs, freqs)), cast to q's dtype before use.
    """
    _check(positions, q, k, cos_cache, sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(num_heads)
    block_hk = triton.next_power_of_2(max(num_kv_heads, 1))
    max_tile = _MAX_TILE_INTERPRET if interpreting() else _MAX_TILE
    block_t = max(1, min(triton.next_power_of_2(num_tokens), max_tile // (block_hq * block_half)))
    grid = (triton.cdiv(num_tokens, block_t),)
    _rotary_kernel[grid](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_cache,
        sin_cache,
        num_tokens,
        num_heads,
        num_kv_heads,
        half,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
    )
    return q_out, k_out
