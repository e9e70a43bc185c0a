"""Weight-only quantized matmuls in Triton (twins: kernels/reference_quant.py): y = x @ W.T with W
read as 4-bit groups or int8 rows and dequantized tile by tile, never whole.

- int4: `qweight` int32 (K / 8, N), eight 4-bit values along K per word, lowest bits first (GPTQ's
  packing, transposed from the (N, K) weight); `scales` and `offsets` float32 (K / group, N):
  W[n, k] = q * scale + offset of k's group (offset = -zero * scale for a checkpoint's grid).
- int8: `qweight` int8 (N, K), `scales` float32 (N,): W[n, k] = q * scale[n]; the product of the
  codes is accumulated first and scaled once per output column.
Decode reads every weight once per step: 4 bits (plus 8 bytes of scale and offset per group and
column) instead of bfloat16's 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_device, check_shape, check_tensor, interpreting
from kernels.paged_attention import dot_precision


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        # each word holds 8 consecutive k: the tile loads it 8 times (from cache) and shifts
        words = tl.load(qweight_ptr + (k // 8)[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0)
        q = (words >> ((k % 8) * 4)[:, None]) & 0xF  # (BLOCK_K, BLOCK_N)
        meta = (k // GROUP)[:, None] * stride_sg + offs_n[None, :]
        scale = tl.load(scales_ptr + meta, mask=w_mask, other=0.0)
        offset = tl.load(offsets_ptr + meta, mask=w_mask, other=0.0)
        w = (q.to(tl.float32) * scale + offset).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w_ptrs = qweight_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + k[:, None]  # (BLOCK_K, BLOCK_N)
        q = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc += tl.dot(x, q.to(x.dtype), input_precision=PRECISION)  # |q| <= 127: exact in any float
    scale = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(o_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    check_tensor("x", x, ndim=x.dim())
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension must be the weight's {k} inputs, got {x.shape[-1]}")
    return x.reshape(-1, k)


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode's few rows get a 16-row tile (tl.dot's least)."""
    if interpreting():  # the interpreter pays per program and per op, not per element
        return max(16, min(triton.next_power_of_2(m), 64)), 64, 128
    return (16 if m <= 16 else 64), 64, 64


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) in x's dtype, W dequantized from 4-bit groups (module docstring)."""
    check_device(x, qweight, scales, offsets)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if group_size < 8 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size must be a power of two >= 8 dividing {k} inputs, got {group_size}")
    for name, t in (("scales", scales), ("offsets", offsets)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,))
        check_shape(name, t, (k // group_size, n))
    if scales.stride() != offsets.stride():
        raise ValueError("scales and offsets must share strides")
    rows = _rows(x, k)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k = _blocks(rows.shape[0])
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](
        rows,
        qweight,
        scales,
        offsets,
        out,
        rows.shape[0],
        n,
        k,
        rows.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
    )
    return out.reshape(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (qweight * scales[:, None]).T -> (..., N) in x's dtype."""
    check_device(x, qweight, scales)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int8,))
    n, k = qweight.shape
    check_tensor("scales", scales, ndim=1, dtypes=(torch.float32,))
    check_shape("scales", scales, (n,))
    rows = _rows(x, k)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k = _blocks(rows.shape[0])
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, block_n))
    _int8_matmul_kernel[grid](
        rows,
        qweight,
        scales,
        out,
        rows.shape[0],
        n,
        k,
        rows.stride(0),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
    )
    return out.reshape(*x.shape[:-1], n)
