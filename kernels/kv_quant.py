"""Quantized KV cache formats: what a code and its scale mean, in torch (the reference).

A quantized pool stores, per layer, codes of shape (num_blocks, block_size, num_kv_heads, head_dim)
in int8 or float8_e4m3fn and one float16 scale per token and KV head, (num_blocks, block_size,
num_kv_heads), beside them. A token's head is quantized on its own (its absolute maximum maps to
the format's largest code), so a stored token never changes when other tokens arrive: batches,
chunking and prefix sharing see the same values. With head_dim 64, a token-head costs 66 bytes
against bfloat16's 128 (1.94x the blocks in the same memory) and float32's 256 (3.9x).

The Triton kernels (kernels/store_kv.py, paged_attention.py, prefill_attention.py) compute the
same codes: round half up (floor(y + 0.5)) for int8, round to nearest even for fp8, both after a
true division by the float16 scale.
"""

from __future__ import annotations

import torch

# kv_cache_dtype -> the dtype of the stored codes
KV_CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float16
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
# The smallest scale kept: float16's smallest normal number, so a scale never loses precision as a
# subnormal (a head whose values are all below 127 * 2**-14 is still stored within 2**-15 of them).
MIN_SCALE = 2.0**-14


def code_max(code_dtype: torch.dtype) -> float:
    """The largest code magnitude of a format."""
    if code_dtype == torch.int8:
        return INT8_MAX
    if code_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    raise ValueError(f"no quantized KV format stores {code_dtype}")


def is_quantized(cache: torch.Tensor) -> bool:
    """True for a pool of codes (int8 or float8), False for one of plain values."""
    return cache.dtype in (torch.int8, torch.float8_e4m3fn)


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> codes (..., head_dim) of code_dtype and float16 scales (...)."""
    top = code_max(code_dtype)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = (amax / top).to(SCALE_DTYPE).clamp_min(MIN_SCALE)
    y = (xf / scale.to(torch.float32).unsqueeze(-1)).clamp(-top, top)
    if code_dtype == torch.int8:
        return torch.floor(y + 0.5).to(torch.int8), scale
    return y.to(code_dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., head_dim) and scales (...) -> values (..., head_dim) in dtype (product in fp32)."""
    return (codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The pool as bytes of the same shape where torch lacks an op for float8 (index_copy_ on CPU)
    and for Triton, which reads fp8 codes as bytes and reinterprets them."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
