"""Paged decode attention, flash-decoding style: one query token per sequence, the KV length
split across programs, then a second pass merging the partial results by log-sum-exp.

A program handles every query head of one KV group (GQA) for one slice of one sequence's
context, so each K/V tile is read once per group. The split count depends only on the batch
shape (never on the tensor contents), so a CUDA graph captured for a batch size stays valid
whatever the context lengths.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.checks import KV_CACHE_DTYPES, check_device, check_shape, check_tensor, interpreting
from kernels.split_kv import MAX_SPLITS, choose_num_splits

LOG2E = math.log2(math.e)
# QUANT meta-parameter: how a cache tile is read
PLAIN, INT8, FP8_E4M3 = 0, 1, 2


@triton.jit
def load_kv_tile(
    cache_ptr, scale_ptr, off, scale_off, kv_mask, n_mask, offs_d, dtype: tl.constexpr, QUANT: tl.constexpr
):
    """A (BLOCK_N, BLOCK_D) tile of K or V in `dtype`: plain values, or codes times their
    per-token scales (fp8 codes arrive as bytes and are reinterpreted)."""
    x = tl.load(cache_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
    if QUANT != 0:
        scales = tl.load(scale_ptr + scale_off, mask=n_mask, other=0.0).to(tl.float32)
        if QUANT == 2:
            x = x.to(tl.float8e4nv, bitcast=True)
        x = (x.to(tl.float32) * scales[:, None]).to(dtype)
    return x


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # this program's slice of the context: whole BLOCK_N tiles, the last slice shorter
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D): the group's heads, padded with zero rows
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        # int64: block id times the block stride overflows 32 bits in large pools
        block = tl.load(table_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = block * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        s_off = block * stride_sb + (tok % BLOCK_SIZE) * stride_ss + kv_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv_tile(k_cache_ptr, k_scale_ptr, off, s_off, kv_mask, n_mask, offs_d, q.dtype, QUANT)
        v = load_kv_tile(v_cache_ptr, v_scale_ptr, off, s_off, kv_mask, n_mask, offs_d, q.dtype, QUANT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    empty = lsum == 0.0  # a slice past the context (or a padding row with no context)
    out = acc / tl.where(empty, 1.0, lsum)[:, None]
    st_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=st_mask)
    else:
        # partials: (num_seqs, num_heads, NUM_SPLITS, HEAD_DIM) float32 and lse (.., NUM_SPLITS)
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=st_mask)
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, lsum)))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    row0 = (seq * NUM_HEADS + offs_h) * NUM_SPLITS  # (BLOCK_H,) first split of each head
    lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(part_lse_ptr + row0 + s, mask=h_mask, other=float("-inf")))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no context at all: output zeros
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    wsum = tl.zeros([BLOCK_H], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_lse_ptr + row0 + s, mask=h_mask, other=float("-inf")) - lse_max)
        part = tl.load(part_out_ptr + (row0 + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * part
        wsum += w
    out = acc / tl.where(wsum == 0.0, 1.0, wsum)[:, None]
    o_ptrs = out_ptr + seq * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact IEEE products (tl.dot would round them to TF32 on NVIDIA GPUs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


class KVArgs(NamedTuple):
    """What a kernel reads a (possibly quantized) pool through."""

    k: torch.Tensor  # values, int8 codes, or fp8 codes as bytes
    v: torch.Tensor
    k_scale: torch.Tensor  # float16 (num_blocks, block_size, kv_heads); the pool itself when unused
    v_scale: torch.Tensor
    stride_sb: int
    stride_ss: int
    quant: int  # PLAIN, INT8 or FP8_E4M3


def kv_scale_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> KVArgs:
    """A plain cache passes itself as unused scale pointers; a quantized one needs its float16
    scales (num_blocks, block_size, num_kv_heads), contiguous."""
    if not kv_quant.is_quantized(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} cache takes no scales")
        return KVArgs(k_cache, v_cache, k_cache, v_cache, 0, 0, PLAIN)
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale")
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, t, ndim=3, dtypes=(kv_quant.SCALE_DTYPE,))
        check_shape(name, t, (num_blocks, block_size, num_kv_heads))
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    quant = INT8 if k_cache.dtype == torch.int8 else FP8_E4M3
    k_codes, v_codes = kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache)
    return KVArgs(k_codes, v_codes, k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), quant)


def check_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[int, int]:
    """Query (tokens, heads, dim) against a cache (num_blocks, block_size, kv_heads, dim) of its
    dtype (or of int8/fp8 codes), int32 block tables and context lengths, one per sequence;
    returns (block_size, kv_heads)."""
    check_tensor("query", query, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share dtype and strides")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if k_cache.stride(2) != head_dim:
        raise ValueError(f"k_cache heads must be contiguous rows of head_dim, got strides {k_cache.stride()}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query (heads {num_heads}, dim {query.shape[2]}) does not fit a cache of {num_kv_heads} KV "
            f"heads of dim {head_dim}"
        )
    if query.dtype != k_cache.dtype and not kv_quant.is_quantized(k_cache):
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have {num_seqs} rows, got {block_tables.shape[0]}")
    return block_size, num_kv_heads


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_context: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its cached context (the new token's K/V stored).

    query: (num_seqs, num_heads, head_dim); caches: (num_blocks, block_size, num_kv_heads,
    head_dim), plain or int8/fp8 codes with their scales; block_tables: (num_seqs, max_blocks) int32;
    context_lens: (num_seqs,) int32, 0 for a padding row (its output is zeros). `num_splits`
    defaults to `choose_num_splits` with `max_context` (default: the block table's width in
    tokens, which needs no device sync). Returns (num_seqs, num_heads, head_dim) in the query's dtype.
    """
    check_device(query, k_cache, v_cache, block_tables, context_lens)
    block_size, num_kv_heads = check_paged_attention(query, k_cache, v_cache, block_tables, context_lens)
    kv = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    check_device(query, kv.k_scale, kv.v_scale)
    num_seqs, num_heads, head_dim = query.shape
    check_shape("context_lens", context_lens, (num_seqs,))
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:  # unused: the kernel writes the output directly
        part_out = part_lse = out
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv.k,
        kv.v,
        kv.k_scale,
        kv.v_scale,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
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
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=128 if interpreting() else 64,  # the interpreter pays per op, not per element
        NUM_SPLITS=num_splits,
        PRECISION=dot_precision(query.dtype),
        QUANT=kv.quant,
        num_warps=8,  # 4 warps need 255 registers and spill at head_dim 128 (ptxas, sm_90a)
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs,)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
        )
    return out
