"""RMSNorm and fused residual add + RMSNorm in Triton (twins: reference.rms_norm, fused_add_rms_norm).

Rows are addressed as (outer, inner) pairs with one stride each, so the Qwen3 q/k norm runs on
(num_tokens, heads, head_dim) views of a fused qkv tensor without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_device, check_shape, check_tensor, interpreting

_MAX_TILE = 4096  # elements per program on GPU: one row of a wide hidden, or many rows of a head_dim
_MAX_TILE_INTERPRET = 1 << 16  # the interpreter pays per program, not per element


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    num_inner,
    hidden,
    eps,
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # row r of x is (outer, inner) = divmod(r, num_inner); out is contiguous (num_rows, hidden)
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    mask = (offs_m < num_rows)[:, None] & mask_n[None, :]
    outer = (offs_m // num_inner).to(tl.int64)
    inner = (offs_m % num_inner).to(tl.int64)
    x_offs = (outer * stride_xo + inner * stride_xi)[:, None] + offs_n[None, :]  # (BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the sum is rounded to the input dtype (torch adds in it), then written back as the residual
        r_offs = (outer * stride_ro + inner * stride_ri)[:, None] + offs_n[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + r_offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=1) / hidden  # (BLOCK_M,)
    h = h * tl.rsqrt(variance + eps)[:, None]
    w = tl.load(w_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    # HF order: round to the input dtype first, then multiply by the weight
    y = h.to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * hidden + offs_n[None, :]
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(*tensors: torch.Tensor) -> tuple[int, int, list[tuple[int, int]]]:
    """Leading dims of same-shaped tensors as (outer, inner) rows: (num_rows, num_inner, strides).

    strides[i] is (stride_outer, stride_inner) of tensors[i]; raises ValueError when some tensor's
    leading dims need more than two strides (e.g. a transposed view).
    """
    shape = tuple(tensors[0].shape[:-1])
    # groups of merged dims, innermost first: [size, [stride of each tensor]]
    groups: list[tuple[int, list[int]]] = []
    for dim in reversed(range(len(shape))):
        size = shape[dim]
        if size == 1:
            continue  # any stride addresses a single index
        strides = [t.stride(dim) for t in tensors]
        if groups:
            inner_size, inner_strides = groups[-1]
            if all(s == si * inner_size for s, si in zip(strides, inner_strides, strict=True)):
                groups[-1] = (inner_size * size, inner_strides)
                continue
        groups.append((size, strides))
    if len(groups) > 2:
        raise ValueError(
            "leading dimensions must be addressable with two strides (outer, inner), got strides "
            + ", ".join(str(t.stride()) for t in tensors)
        )
    num_rows = 1
    for size in shape:
        num_rows *= size
    inner_size, inner_strides = groups[0] if groups else (1, [0] * len(tensors))
    outer_strides = groups[1][1] if len(groups) == 2 else [0] * len(tensors)
    return num_rows, inner_size, list(zip(outer_strides, inner_strides, strict=True))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_rows, num_inner, strides = _row_layout(x) if residual is None else _row_layout(x, residual)
    if num_rows == 0 or hidden == 0:
        return out
    (stride_xo, stride_xi), (stride_ro, stride_ri) = strides[0], strides[-1]
    block_n = triton.next_power_of_2(hidden)
    max_tile = _MAX_TILE_INTERPRET if interpreting() else _MAX_TILE
    block_m = max(1, min(triton.next_power_of_2(num_rows), max_tile // block_n))
    grid = (triton.cdiv(num_rows, block_m),)
    _rms_norm_kernel[grid](
        x,
        x if residual is None else residual,
        weight,
        out,
        num_rows,
        num_inner,
        hidden,
        eps,
        stride_xo,
        stride_xi,
        stride_ro,
        stride_ri,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=8 if block_m * block_n >= 8192 else 4,
    )
    return out


def _check_x_and_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., hidden), got a scalar")
    check_tensor("x", x, ndim=x.dim())
    check_tensor("weight", weight, ndim=1)
    check_shape("weight", weight, (x.shape[-1],))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., hidden) into a new contiguous tensor (x untouched).

    Leading dims may be any view addressable with two strides (e.g. (num_tokens, heads,
    head_dim) split from a fused qkv); the result has dtype promote(x.dtype, weight.dtype).
    """
    check_device(x, weight)
    _check_x_and_weight(x, weight)
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x IN PLACE (in x's dtype); returns (rms_norm(residual) as a new tensor, residual).

    x and residual: same shape and dtype (..., hidden), each any view addressable with two strides.
    """
    check_device(x, residual, weight)
    _check_x_and_weight(x, weight)
    check_tensor("residual", residual, ndim=x.dim(), dtypes=(x.dtype,))
    check_shape("residual", residual, tuple(x.shape))
    if any(n > 1 and s == 0 for n, s in zip(residual.shape, residual.stride(), strict=True)):
        raise ValueError(
            f"residual is written in place and must not be expanded, got strides {residual.stride()}"
        )
    return _launch(x, residual, weight, eps), residual
