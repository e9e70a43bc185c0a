"""Launchers of the CPU matrix-vector kernels, float32 and per-channel int8 weights (cpu_gemv.c;
built by kernels/cpu_native.py).

A decode step of one sequence reads every weight once for one row; MKL does that at a third of the
memory bandwidth that a plain streamed dot product reaches on our VMs (docs/BENCHMARKS.md), so
the torch backend without batch invariance sends float32 projections of up to `MAX_ROWS` rows
here, and int8 weights' products of up to engine.layers.quant.INT8_ROWS (`int8`). The reference is
`F.linear` (tests/kernels/test_cpu_gemv.py; the int8 one in tests/engine/test_quant.py).
"""

from __future__ import annotations

import ctypes

import torch

_P, _L = ctypes.c_void_p, ctypes.c_long

# Up to this many rows the kernel beats MKL (1-2 rows: 2-3x; at 4 rows they are even, past it MKL
# is faster): a step of one or two decoding sequences.
MAX_ROWS = 2


class CpuGemv:
    """`gemv(x, w)` is `x @ w.T` for contiguous float32 CPU tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemv = library.gemv_f32  # (x, rows, k, w, n, y)
        self._gemv.argtypes = [_P, _L, _L, _P, _L, _P]
        self._gemv.restype = None
        self._gemv_i8 = library.gemv_i8  # (x, rows, k, w, scales, n, y)
        self._gemv_i8.argtypes = [_P, _L, _L, _P, _P, _L, _P]
        self._gemv_i8.restype = None
        self._threads = library.gemv_max_threads
        self._threads.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(rows, k) @ (n, k).T -> (rows, n), float32."""
        if x.dtype != torch.float32 or w.dtype != torch.float32:
            raise ValueError(f"the CPU gemv takes float32, got {x.dtype} and {w.dtype}")
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"shapes do not multiply: x {tuple(x.shape)} @ w {tuple(w.shape)}.T")
        if x.device.type != "cpu" or w.device.type != "cpu":
            raise ValueError("the CPU gemv takes CPU tensors")
        if not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("the CPU gemv takes contiguous tensors")
        rows, n = x.shape[0], w.shape[0]
        y = torch.empty((rows, n), dtype=torch.float32)
        if rows and n:
            self._gemv(x.data_ptr(), rows, x.shape[1], w.data_ptr(), n, y.data_ptr())
        return y

    def int8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(rows, k) @ (qweight (n, k) int8 * scales (n,) float32 per output channel).T -> (rows, n)."""
        if x.dtype != torch.float32 or qweight.dtype != torch.int8 or scales.dtype != torch.float32:
            raise ValueError(
                f"the int8 gemv takes float32, int8, float32; got {x.dtype}, {qweight.dtype}, {scales.dtype}"
            )
        if (
            x.dim() != 2
            or qweight.dim() != 2
            or x.shape[1] != qweight.shape[1]
            or scales.shape != qweight.shape[:1]
        ):
            raise ValueError(
                f"shapes do not multiply: x {tuple(x.shape)} @ w {tuple(qweight.shape)}.T, "
                f"scales {tuple(scales.shape)}"
            )
        if not (x.is_contiguous() and qweight.is_contiguous() and scales.is_contiguous()):
            raise ValueError("the int8 gemv takes contiguous tensors")
        if x.device.type != "cpu" or qweight.device.type != "cpu":
            raise ValueError("the int8 gemv takes CPU tensors")
        rows, n = x.shape[0], qweight.shape[0]
        y = torch.empty((rows, n), dtype=torch.float32)
        if rows and n:
            self._gemv_i8(
                x.data_ptr(), rows, x.shape[1], qweight.data_ptr(), scales.data_ptr(), n, y.data_ptr()
            )
        return y

    def max_threads(self) -> int:
        """The threads one call runs on."""
        return int(self._threads())
