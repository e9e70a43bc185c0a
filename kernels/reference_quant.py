"""Torch twins of kernels/quant_matmul.py, and the int4 layout's packing (the definition of it)."""

from __future__ import annotations

import torch


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> int8 codes (out, in) and float32 scales (out,): symmetric per row,
    scale = max |row| / 127 (the int8 layout of int8_matmul)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) weight -> values q (out, in) uint8 in 0..15 and float32 scales and offsets (out,
    in / group): asymmetric over each group's range, w ~ q * scale + low with scale = (high - low) /
    15 (GGUF Q4_1's rule: a weight that came from Q4_1 blocks gets its own values back, to float32's
    rounding); a constant group keeps its value exactly (q = 0)."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int4 in groups of {group} needs rows of a multiple of it, got {in_features}")
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15)
    return q.reshape(out_features, in_features).to(torch.uint8), scale, low


def group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input permutation that makes a checkpoint's groups contiguous (GPTQ act-order), or None
    when input i already belongs to group i // group_size; refuses groups not of group_size."""
    order = torch.arange(g_idx.shape[0], device=g_idx.device) // group_size
    if torch.equal(g_idx, order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], order):
        raise ValueError(f"every input group must hold {group_size} inputs")
    return perm


def in_checkpoint_order(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """A weight whose columns were put in group order (`group_order`'s perm) back in the checkpoint's."""
    return w if perm is None else torch.empty_like(w).index_copy_(1, perm, w)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in 0..15 -> (K / 8, N) int32: k = 8 * row + j at bits 4j..4j+3 of the word."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"int4 packing needs K in multiples of 8, got {k}")
    v = q.t().to(torch.int64).reshape(k // 8, 8, n)
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= v[:, j] << (4 * j)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, as int32


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: (K / 8, N) int32 -> (N, K) int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    values = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # (K / 8, 8, N)
    return values.reshape(-1, qweight.shape[1]).t()


def int4_weight(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 (N, K) weight of an int4 layout."""
    q = unpack_int4(qweight).float()  # (N, K)
    groups = torch.arange(q.shape[1], device=q.device) // group_size
    return q * scales.t()[:, groups] + offsets.t()[:, groups]


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (..., K) @ W.T in x's dtype; W dequantized to x's dtype first (as the kernel's tiles are)."""
    w = int4_weight(qweight, scales, offsets, group_size).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (qweight * scales[:, None]).T in x's dtype, accumulated in float32."""
    return ((x.float() @ qweight.float().t()) * scales.float()).to(x.dtype)
