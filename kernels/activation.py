"""SiLU-and-multiply (SwiGLU's activation) in Triton (twin: reference.silu_and_mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_device, check_tensor, interpreting

_MAX_TILE = 4096  # output elements per program on GPU
_MAX_TILE_INTERPRET = 1 << 16  # the interpreter pays per program, not per element


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    d,
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # x: (num_rows, 2 * d) rows stride_xm apart; out: contiguous (num_rows, d)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < num_rows)[:, None] & (offs_n < d)[None, :]
    x_offs = offs_m[:, None] * stride_xm + offs_n[None, :]  # (BLOCK_M, BLOCK_N)
    gate = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + x_offs + d, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # silu rounded to x's dtype before the product, as torch (and vLLM) round it
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * d + offs_n[None, :], (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) -> silu(x[..., :d]) * x[..., d:] as a new contiguous tensor in x's dtype.

    Computed in float32; rows of x (all leading dims) must be one uniform stride apart.
    """
    check_device(x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., 2 * d), got a scalar")
    check_tensor("x", x, ndim=x.dim())
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even (gate and up halves), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    try:
        rows = x.view(-1, 2 * d)  # (num_rows, 2 * d)
    except RuntimeError as e:
        raise ValueError(f"rows of x must be one uniform stride apart, got strides {x.stride()}") from e
    num_rows = rows.shape[0]
    max_tile = _MAX_TILE_INTERPRET if interpreting() else _MAX_TILE
    block_n = min(triton.next_power_of_2(d), max_tile)
    block_m = max(1, min(triton.next_power_of_2(num_rows), max_tile // block_n))
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(d, block_n))
    _silu_and_mul_kernel[grid](rows, out, num_rows, d, rows.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return out
