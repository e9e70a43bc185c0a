"""Argument checks shared by the Triton launchers: they raise ValueError with the argument's name."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8, torch.float8_e4m3fn)  # values, or quantized codes


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and one Triton can run on (CUDA, or the CPU under the interpreter)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels run on CUDA tensors, or on the CPU with TRITON_INTERPRET=1 set before "
            f"triton is imported; got tensors on {device}"
        )


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    contiguous_last: bool = True,
) -> None:
    """Rank, dtype and (by default) a unit stride on the last dimension."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if contiguous_last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Exact shape."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_power_of_two(name: str, value: int) -> None:
    """Block sizes and head dims index tl.arange, which needs powers of two."""
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
