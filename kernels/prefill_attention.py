"""Prefill / extend attention: a varlen batch of new tokens attending causally to themselves and
to their already-cached prefix, reading every key and value through the block table.

The new tokens' K/V must already be stored in the cache (store_kv runs first), so one loop over
the paged context serves fresh prompts, chunked prefill and prefix-cache hits alike. A program
takes BLOCK_M query tokens times every head of one KV group, folded into the rows of one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_device, check_shape, check_tensor, interpreting
from kernels.paged_attention import LOG2E, check_paged_attention, dot_precision, kv_scale_args, load_kv_tile


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    block_table_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    prefix = tl.load(context_lens_ptr + seq) - q_len  # tokens cached before the new ones

    # row r of the tile: new token m_block * BLOCK_M + r // GROUP_PAD, head r % GROUP_PAD of the group
    offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = m_block * BLOCK_M + offs_r // GROUP_PAD
    g = offs_r % GROUP_PAD
    r_mask = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    pos = prefix + tok  # absolute position of each row's token
    # keys up to the last real token of this tile (none when the tile starts past q_len)
    kv_end = tl.where(m_block * BLOCK_M < q_len, prefix + tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len), 0)

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        kn = n0 + offs_n
        n_mask = kn < kv_end
        block = tl.load(table_row + kn // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = block * stride_cb + (kn % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        s_off = block * stride_sb + (kn % BLOCK_SIZE) * stride_ss + kv_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv_tile(k_cache_ptr, k_scale_ptr, off, s_off, kv_mask, n_mask, offs_d, q.dtype, QUANT)
        v = load_kv_tile(v_cache_ptr, v_scale_ptr, off, s_off, kv_mask, n_mask, offs_d, q.dtype, QUANT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # causal; key 0 is visible to every row, so no row's running max stays -inf
        s = tl.where(n_mask[None, :] & (kn[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(lsum == 0.0, 1.0, lsum)[:, None]
    o_ptrs = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached prefix and themselves, through block tables.

    query: (num_tokens, num_heads, head_dim), sequence b's tokens at cu_seqlens_q[b]:cu_seqlens_q[b+1]
    (int32); context_lens[b] (int32) counts its cached prefix plus its new tokens, whose K/V must
    already be stored. `max_query_len` sizes the grid (computed from cu_seqlens_q if omitted,
    which syncs with the device). A quantized cache (int8/fp8 codes) comes with its scales.
    Returns (num_tokens, num_heads, head_dim) in the query's dtype.
    """
    check_device(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    block_size, num_kv_heads = check_paged_attention(query, k_cache, v_cache, block_tables, context_lens)
    kv = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    check_device(query, kv.k_scale, kv.v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # rows per tile: 128 on the GPU; the interpreter pays per program and per op, not per element
    rows = 256 if interpreting() else 128
    block_n = 128 if interpreting() else 64
    block_m = max(1, rows // group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_m * group_pad < 16:
        block_m = 16 // group_pad  # tl.dot needs at least 16 rows
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query,
        kv.k,
        kv.v,
        kv.k_scale,
        kv.v_scale,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kv.stride_sb,
        kv.stride_ss,
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PRECISION=dot_precision(query.dtype),
        QUANT=kv.quant,
        num_warps=4 if interpreting() else 8,  # a 128-row tile and its fp32 accumulator
    )
    return out
