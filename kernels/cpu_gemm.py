"""Launcher of the CPU float32 matrix product over panel-packed weights (cpu_gemm.c; built by
kernels/cpu_native.py).

`pack` lays a weight (n, k) out once, at load time, as ceil(n / 16) panels of (k, 16) (zeros past
n); `CpuGemm(x, packed, n)` is then `x @ w.T` for any number of rows, each row's bits the same
whatever the rows beside it (every output one chain of multiply-adds over k in order). Faster than
MKL's sgemm at every row count on the VMs we measure on (1.1-1.2x for prefills, 1.4-2.3x at 16-32
rows, 2-7x at 1-4: docs/BENCHMARKS.md). The reference is `F.linear` (tests/kernels/test_cpu_gemm.py).
"""

from __future__ import annotations

import ctypes

import torch

_P, _L = ctypes.c_void_p, ctypes.c_long


class CpuGemm:
    """`gemm(x, packed, n)`: (rows, k) float32 @ the packed (n, k) weight's transpose -> (rows, n)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemm = library.gemm_f32  # (x, rows, k, packed, n, y)
        self._gemm.argtypes = [_P, _L, _L, _P, _L, _P]
        self._gemm.restype = None
        self._gemm_i8 = library.gemm_i8  # (x, rows, k, packed, scales, n, y)
        self._gemm_i8.argtypes = [_P, _L, _L, _P, _P, _L, _P]
        self._gemm_i8.restype = None
        self._threads = library.gemm_max_threads
        self._threads.restype = ctypes.c_int
        self.panel = int(library.gemm_panel_width())
        self.vectorized = bool(library.gemm_vectorized())  # False: correct scalar sums, too slow to use

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(n, k) float32 or int8 -> (ceil(n / panel), k, panel), contiguous, zero past row n."""
        if (
            weight.dtype not in (torch.float32, torch.int8)
            or weight.dim() != 2
            or weight.device.type != "cpu"
        ):
            raise ValueError(
                f"packs a 2-D float32 or int8 CPU weight, got {tuple(weight.shape)} {weight.dtype}"
            )
        n, k = weight.shape
        panels = -(-n // self.panel)
        padded = weight.new_zeros(panels * self.panel, k)
        padded[:n] = weight
        return padded.view(panels, self.panel, k).transpose(1, 2).contiguous()

    def pack_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-channel scales (n,) as float32, padded to the panels' width (zeros past n)."""
        n = scales.shape[0]
        padded = torch.zeros(-(-n // self.panel) * self.panel, dtype=torch.float32)
        padded[:n] = scales.float()
        return padded

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x (rows, k) @ w.T -> (rows, n) float32, `packed` = pack(w) of a float32 w with n rows."""
        if packed.dtype != torch.float32:
            raise ValueError(f"the CPU gemm takes float32 panels, got {packed.dtype}")
        return self._run(x, packed, None, n)

    def int8(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        """x (rows, k) @ (codes * scales[:, None]).T -> (rows, n) float32, `packed` = pack(codes) of
        int8 codes (n, k) and `scales` = pack_scales(per-channel scales)."""
        if packed.dtype != torch.int8 or scales.dtype != torch.float32:
            raise ValueError(
                f"the int8 gemm takes int8 panels and float32 scales, got {packed.dtype}, {scales.dtype}"
            )
        if scales.dim() != 1 or scales.shape[0] != packed.shape[0] * self.panel or not scales.is_contiguous():
            raise ValueError(f"scales {tuple(scales.shape)} do not fit panels {tuple(packed.shape)}")
        return self._run(x, packed, scales, n)

    def _run(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"the CPU gemm takes float32 activations, got {x.dtype}")
        if x.device.type != "cpu" or packed.device.type != "cpu":
            raise ValueError("the CPU gemm takes CPU tensors")
        if (
            x.dim() != 2
            or packed.dim() != 3
            or packed.shape[2] != self.panel
            or packed.shape[1] != x.shape[1]
            or not 0 <= n <= packed.shape[0] * self.panel
            or n <= (packed.shape[0] - 1) * self.panel
        ):
            raise ValueError(
                f"shapes do not multiply: x {tuple(x.shape)} @ packed {tuple(packed.shape)} for {n} outputs"
            )
        if not (x.is_contiguous() and packed.is_contiguous()):
            raise ValueError("the CPU gemm takes contiguous tensors")
        rows = x.shape[0]
        y = torch.empty((rows, n), dtype=torch.float32)
        if rows and n and x.shape[1] and scales is not None:
            self._gemm_i8(
                x.data_ptr(), rows, x.shape[1], packed.data_ptr(), scales.data_ptr(), n, y.data_ptr()
            )
        elif rows and n and x.shape[1]:
            self._gemm(x.data_ptr(), rows, x.shape[1], packed.data_ptr(), n, y.data_ptr())
        elif rows and n:
            y.zero_()
        return y

    def max_threads(self) -> int:
        """The threads one call runs on (torch's OpenMP runtime: torch.set_num_threads)."""
        return int(self._threads())
