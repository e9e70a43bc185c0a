"""Torch reference implementations of the engine's kernels.

They are the CPU execution path and the oracle every Triton kernel is tested against.
KV caches are laid out per layer as (num_blocks, block_size, num_kv_heads, head_dim); a slot
is `block_id * block_size + offset`; block tables are int32 (num_seqs, max_blocks_per_seq)
padded with any valid block id, context lengths say how many slots of each row are real.
A quantized cache holds int8 or float8 codes with float16 scales (num_blocks, block_size,
num_kv_heads) beside it (`k_scale`, `v_scale`; formats in kernels/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import kv_quant


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new tokens' K/V into the paged cache; slots < 0 are padding and skipped.

    key, value: (num_tokens, num_kv_heads, head_dim); slot_mapping: (num_tokens,) int. With
    scales, the cache holds codes: each token's heads are quantized and their scales stored.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if k_scale is None or v_scale is None:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))
        return
    # K and V quantized in one pass (each token-head on its own either way: the same codes)
    codes, s = kv_quant.quantize(torch.stack((key, value)), k_cache.dtype)
    for cache, scales, c, sc in ((k_cache, k_scale, codes[0], s[0]), (v_cache, v_scale, codes[1], s[1])):
        kv_quant.storage_view(cache).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, kv_quant.storage_view(c)
        )
        scales.view(-1, num_kv_heads).index_copy_(0, slots, sc)


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: (length, num_kv_heads, head_dim); a
    quantized cache's (with its scales) are dequantized to `dtype`."""
    num_blocks = -(-length // cache.shape[1])
    # index_select copies whole blocks in one pass; advanced indexing is several times slower on CPU
    index = block_table[:num_blocks].to(torch.int64)
    blocks = cache.index_select(0, index).view(-1, cache.shape[2], cache.shape[3])[:length]
    if scales is None:
        return blocks
    assert dtype is not None
    return kv_quant.dequantize(blocks, scales.index_select(0, index).view(-1, cache.shape[2])[:length], dtype)


_DECODE_GROUP = 8  # sequences attended together: fewer calls, little padding once sorted by length
# Batch-invariant mode. torch's CPU flash attention splits keys into blocks of 512 (one shorter
# block at the end) and its sums depend on the block lengths; a fully masked block adds exactly
# nothing; GEMMs round differently below 4 rows. So a query's result depends only on its key span
# (the padded key count) as long as query rows come in multiples of 4, with the heads of a KV group
# folded into rows. Each query at position p gets the span `_bucket(p + 1)`, p + 1 rounded up to a
# multiple of 64: a function of the query's own position, the same whatever the batch, the
# chunking or the cache, so those runs agree bit for bit. Decode groups hold sequences of one span;
# a prefill chunk is attended in runs of rows that share one (at most one run per 64 positions).
_SPAN_STEP = 64
ROW_MULTIPLE = 4  # GEMM row counts that round every row alike (see _folded_attention)


def _bucket(length: int) -> int:
    """The key span of a query whose context holds `length` tokens (batch-invariant mode)."""
    return -(-length // _SPAN_STEP) * _SPAN_STEP


def _kv_span(length: int, batch_invariant: bool) -> int:
    return _bucket(length) if batch_invariant else length


def _padded_table(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """First `num_blocks` columns, padded with block 0 (finite values; always masked out)."""
    width = block_tables.shape[-1]
    if width >= num_blocks:
        return block_tables[..., :num_blocks]
    pad = block_tables.new_zeros((*block_tables.shape[:-1], num_blocks - width))
    return torch.cat((block_tables, pad), dim=-1)


def _folded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Batch-invariant attention. q: (B, kv_heads, rows, dim) with a KV group's heads folded into
    rows; k, v: (B, kv_heads, span, dim); positions: (B, rows) absolute position of each row.
    """
    rows = q.shape[2]
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    if padded > rows:  # extra rows repeat the last one; their results are dropped
        q = torch.cat((q, q[:, :, -1:].expand(-1, -1, padded - rows, -1)), dim=2)
        positions = torch.cat((positions, positions[:, -1:].expand(-1, padded - rows)), dim=1)
    mask = torch.arange(k.shape[2], device=q.device)[None, None, :] <= positions[:, :, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return out[:, :, :rows]


@dataclass
class DecodeGroup:
    """Sequences attended together, and what every layer reuses for them."""

    index: torch.Tensor | None  # rows of the decode batch (None: all of them, in order)
    flat_blocks: torch.Tensor  # (n * blocks_per_seq,) int64: each row's blocks, padded with block 0
    span: int  # keys per sequence (padded)
    mask: torch.Tensor  # additive (0 / -inf), broadcast against the (n, heads, rows, span) scores
    k_buf: torch.Tensor  # (n * blocks_per_seq, block_size, kv_heads, dim): gather target, reused
    v_buf: torch.Tensor


@dataclass
class DecodePlan:
    """One step's decode attention layout: computed once, used by every layer."""

    groups: list[DecodeGroup]
    batch_invariant: bool


def plan_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: torch.Tensor,
    num_heads: int,
    batch_invariant: bool = False,
    dtype: torch.dtype | None = None,
) -> DecodePlan:
    """Group the decode sequences and precompute their block indices, masks and gather buffers.

    `dtype`: the queries' (default: the cache's; a quantized cache's queries are not codes)."""
    num_seqs = context_lens.shape[0]
    lens = context_lens.tolist()
    spans = [_kv_span(n, batch_invariant) for n in lens]
    dtype = dtype or k_cache.dtype
    if num_seqs <= _DECODE_GROUP and (not batch_invariant or len(set(spans)) == 1):
        group = _plan_group(None, block_tables, context_lens, k_cache, num_heads, batch_invariant, dtype)
        return DecodePlan([group], batch_invariant)
    # Gathering K/V dominates on CPU: sort by length so each group pads only to its own longest
    # (batch-invariant: every member of a group has the same span).
    order = sorted(range(num_seqs), key=lambda i: lens[i])
    runs: list[list[int]] = []
    for i in order:
        if runs and len(runs[-1]) < _DECODE_GROUP and (not batch_invariant or spans[runs[-1][0]] == spans[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    groups = []
    for run in runs:
        idx = torch.tensor(run, dtype=torch.int64, device=context_lens.device)
        groups.append(
            _plan_group(idx, block_tables[idx], context_lens[idx], k_cache, num_heads, batch_invariant, dtype)
        )
    return DecodePlan(groups, batch_invariant)


def _plan_group(
    index: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: torch.Tensor,
    num_heads: int,
    batch_invariant: bool,
    dtype: torch.dtype,
) -> DecodeGroup:
    n = context_lens.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    span = _kv_span(int(context_lens.max()), batch_invariant)
    num_blocks = -(-span // block_size)
    flat = _padded_table(block_tables, num_blocks).reshape(-1).to(torch.int64)
    keys = torch.arange(span, device=k_cache.device)
    last = context_lens.to(device=k_cache.device, dtype=torch.int64) - 1  # the query's own position
    if batch_invariant:  # (n, 1, rows, span), rows: the KV group's heads rounded up to ROW_MULTIPLE
        rows = -(-(num_heads // num_kv_heads) // ROW_MULTIPLE) * ROW_MULTIPLE
        positions = last[:, None].expand(-1, rows)
        allowed = (keys[None, None, :] <= positions[:, :, None])[:, None]
    else:
        allowed = (keys[None, :] <= last[:, None])[:, None, None, :]
    # additive float mask, made once here instead of converted from bool by SDPA in every layer
    mask = torch.zeros(allowed.shape, dtype=dtype, device=k_cache.device)
    mask.masked_fill_(~allowed, float("-inf"))
    shape = (n * num_blocks, block_size, num_kv_heads, head_dim)
    k_buf = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    return DecodeGroup(index, flat, span, mask, k_buf, torch.empty_like(k_buf))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
    plan: DecodePlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context (GQA-aware).

    query: (num_seqs, num_heads, head_dim); context_lens: (num_seqs,) including the new token,
    whose K/V must already be stored. Returns (num_seqs, num_heads, head_dim). `plan` (from
    `plan_decode` with the same tables and lengths) saves redoing the layout in every layer.
    A quantized cache comes with its scales and is dequantized to the query's dtype.
    """
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache, query.shape[1], batch_invariant, query.dtype)
    scales = None if k_scale is None or v_scale is None else (k_scale, v_scale)
    if len(plan.groups) == 1 and plan.groups[0].index is None:
        return _decode_group(query, k_cache, v_cache, plan.groups[0], scale, plan.batch_invariant, scales)
    out = torch.empty_like(query)
    for g in plan.groups:
        assert g.index is not None
        out[g.index] = _decode_group(query[g.index], k_cache, v_cache, g, scale, plan.batch_invariant, scales)
    return out


def _decode_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    scale: float,
    batch_invariant: bool,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    # (num_seqs, kv_heads, span, head_dim), padded past each sequence's length
    torch.index_select(k_cache, 0, g.flat_blocks, out=g.k_buf)
    torch.index_select(v_cache, 0, g.flat_blocks, out=g.v_buf)
    k_all, v_all = g.k_buf, g.v_buf
    if scales is not None:  # codes -> values, block by block as gathered
        k_all = kv_quant.dequantize(k_all, scales[0].index_select(0, g.flat_blocks), query.dtype)
        v_all = kv_quant.dequantize(v_all, scales[1].index_select(0, g.flat_blocks), query.dtype)
    k = k_all.view(num_seqs, -1, num_kv_heads, head_dim)[:, : g.span].transpose(1, 2)
    v = v_all.view(num_seqs, -1, num_kv_heads, head_dim)[:, : g.span].transpose(1, 2)
    if batch_invariant:
        group = num_heads // num_kv_heads
        q = query.view(num_seqs, num_kv_heads, group, head_dim)
        rows = g.mask.shape[2]
        if rows > group:  # extra rows repeat the last one; their results are dropped
            q = torch.cat((q, q[:, :, -1:].expand(-1, -1, rows - group, -1)), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
        return out[:, :, :group].reshape(num_seqs, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.reshape(num_seqs, num_heads, 1, head_dim),
        k,
        v,
        attn_mask=g.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.view(num_seqs, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A varlen batch of new tokens attending causally to themselves and their cached prefix.

    query: (num_tokens, num_heads, head_dim) with sequence b's tokens at
    cu_seqlens_q[b]:cu_seqlens_q[b+1]; context_lens[b] counts its cached prefix plus its new
    tokens (whose K/V must already be stored). Returns (num_tokens, num_heads, head_dim).
    A quantized cache comes with its scales and is dequantized to the query's dtype.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        span = _kv_span(ctx, batch_invariant)
        table = _padded_table(block_tables[b], -(-span // k_cache.shape[1]))
        k = gather_kv(k_cache, table, span, k_scale, query.dtype).transpose(0, 1)  # (kv_heads, span, dim)
        v = gather_kv(v_cache, table, span, v_scale, query.dtype).transpose(0, 1)
        if batch_invariant:
            out[q_start:q_end] = _invariant_prefill(query[q_start:q_end], k, v, ctx - q_len, scale)
            continue
        q = query[q_start:q_end].transpose(0, 1)  # (num_heads, q_len, head_dim)
        if q_len == ctx:
            mask = None
        else:  # query i sits at absolute position ctx - q_len + i
            rows = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None and q_len > 1,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[q_start:q_end] = o.squeeze(0).transpose(0, 1)
    return out


def _invariant_prefill(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """One sequence's new tokens, attended in runs of rows that share a key span (`_bucket`).

    query: (q_len, heads, dim) at positions first_pos...; k, v: (kv_heads, span >= every run's, dim).
    """
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    i, pos = 0, first_pos
    while i < q_len:
        span = _bucket(pos + 1)
        n = min(q_len - i, span - pos)  # rows up to the end of this span share it
        # (1, kv_heads, n * group, head_dim): row j * group + g is token j, head g of the group
        q = query[i : i + n].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
        q = q.reshape(1, num_kv_heads, n * group, head_dim)
        positions = torch.arange(pos, pos + n, device=query.device).repeat_interleave(group)[None]
        o = _folded_attention(q, k[None, :, :span], v[None, :, :span], positions, scale)
        out[i : i + n] = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads, -1)
        i, pos = i + n, pos + n
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32, cast back to the input dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; returns (rms_norm(residual), residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) -> silu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX/HF RoPE, x * cos + rotate_half(x) * sin in q's dtype; returns new tensors.

    positions: (num_tokens,) int; q: (num_tokens, num_heads, head_dim); k: (num_tokens,
    num_kv_heads, head_dim); cos_cache, sin_cache: (max_positions, head_dim), cast to q's dtype
    before the multiply (as HF does).
    """
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)  # (num_tokens, 1, head_dim)
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    q_out = (q * cos) + (rotate_half(q) * sin)
    k_out = (k * cos) + (rotate_half(k) * sin)
    return q_out, k_out
