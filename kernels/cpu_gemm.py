"""Launchers of the CPU matrix products over panel-packed weights (cpu_gemm.c; built by
kernels/cpu_native.py): float32 weights, and per-channel int8 weights.

`pack` lays a float32 weight (n, k) out once, at load time, as ceil(n / 16) panels of (k, 16)
(zeros past n); `CpuGemm(x, packed, n)` is then `x @ w.T` for any number of rows, each row's bits
the same whatever the rows beside it (every output one chain of multiply-adds over k in order).
The reference is `F.linear` (tests/kernels/test_cpu_gemm.py).

`pack_int8` lays int8 codes (n, k) out as panels of (ceil(k / 2), 16, 2); `int8(x, packed, scales,
n)` rounds each row of x to int16 codes with its own scale and multiplies them with the weight's
codes in exact integer sums (two products per instruction and lane: twice float32's work per
instruction), also each row on its own. Its exact reference is `reference_int8_gemm` below.

`pack_w8a8` and `bind_w8a8` are w8a8's product where the CPU has VNNI: each row of x rounded to
int8 codes (max |x| / 127) times int8 codes, four products per lane and instruction, in exact int32
sums: bit for bit what torch._int_mm gives on the same codes (engine/layers/quant.py's W8A8Weight).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P, _L = ctypes.c_void_p, ctypes.c_long
W8A8_MAX_K = 65536  # cpu_gemm.c's: one int32 sum per output stays below 2^31 up to it


class CpuGemm:
    """`gemm(x, packed, n)`: (rows, k) float32 @ the packed (n, k) weight's transpose -> (rows, n)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemm = library.gemm_f32  # (x, rows, k, packed, n, y)
        self._gemm.argtypes = [_P, _L, _L, _P, _L, _P]
        self._gemm.restype = None
        self._gemm_i8 = library.gemm_i8  # (x, rows, k, packed, scales, n, y)
        self._gemm_i8.argtypes = [_P, _L, _L, _P, _P, _L, _P]
        self._gemm_i8.restype = ctypes.c_int
        self._gemm_w8a8 = library.gemm_w8a8  # (x, rows, k, packed, scales, n, y)
        self._gemm_w8a8.argtypes = [_P, _L, _L, _P, _P, _L, _P]
        self._gemm_w8a8.restype = ctypes.c_int
        self._threads = library.gemm_max_threads
        self._threads.restype = ctypes.c_int
        self.panel = int(library.gemm_panel_width())
        self.vectorized = bool(library.gemm_vectorized())  # False: correct scalar sums, too slow to use
        self.vnni = bool(library.gemm_vnni())  # False: no w8a8 product here (torch._int_mm stays)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(n, k) float32 -> (ceil(n / panel), k, panel), contiguous, zero past row n."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"packs a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype}")
        n, k = weight.shape
        panels = -(-n // self.panel)
        padded = weight.new_zeros(panels * self.panel, k)
        padded[:n] = weight
        return padded.view(panels, self.panel, k).transpose(1, 2).contiguous()

    def pack_int8(self, codes: torch.Tensor) -> torch.Tensor:
        """(n, k) int8 codes -> (ceil(n / panel), ceil(k / 2), 2 * panel): each line two consecutive
        inputs of the panel's columns, zero past row n and column k."""
        if codes.dtype != torch.int8 or codes.dim() != 2 or codes.device.type != "cpu":
            raise ValueError(f"packs 2-D int8 CPU codes, got {tuple(codes.shape)} {codes.dtype}")
        n, k = codes.shape
        panels, pairs = -(-n // self.panel), -(-k // 2)
        padded = codes.new_zeros(panels * self.panel, 2 * pairs)
        padded[:n, :k] = codes
        lines = padded.view(panels, self.panel, pairs, 2).permute(0, 2, 1, 3)
        return lines.reshape(panels, pairs, 2 * self.panel).contiguous()

    def unpack_int8(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The (n, k) codes `pack_int8` laid out (exact: packing only reorders)."""
        panels, pairs, _ = packed.shape
        lines = packed.view(panels, pairs, self.panel, 2).permute(0, 2, 1, 3)
        return lines.reshape(panels * self.panel, 2 * pairs)[:n, :k]

    def pack_w8a8(self, codes: torch.Tensor) -> torch.Tensor:
        """(n, k) int8 codes -> (ceil(n / panel), ceil(k / 4), 4 * panel) uint8 codes + 128: each line
        four consecutive inputs of the panel's columns, 128 (code 0) past row n and column k."""
        if codes.dtype != torch.int8 or codes.dim() != 2 or codes.device.type != "cpu":
            raise ValueError(f"packs 2-D int8 CPU codes, got {tuple(codes.shape)} {codes.dtype}")
        n, k = codes.shape
        panels, quads = -(-n // self.panel), -(-k // 4)
        padded = codes.new_zeros(panels * self.panel, 4 * quads)
        padded[:n, :k] = codes
        lines = padded.view(panels, self.panel, quads, 4).permute(0, 2, 1, 3)
        return (lines.reshape(panels, quads, 4 * self.panel).view(torch.uint8) ^ 0x80).contiguous()

    def pack_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-channel scales (n,) as float32, padded to the panels' width (zeros past n)."""
        n = scales.shape[0]
        padded = torch.zeros(-(-n // self.panel) * self.panel, dtype=torch.float32)
        padded[:n] = scales.float()
        return padded

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x (rows, k) @ w.T -> (rows, n) float32, `packed` = pack(w) of a float32 w with n rows."""
        return self.bind(packed, n)(x)

    def int8(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        """x (rows, k) @ (codes * scales[:, None]).T -> (rows, n) float32, `packed` = pack_int8(codes)
        of int8 codes (n, k) and `scales` = pack_scales(per-channel scales); x rounded to int16 per row
        (`reference_int8_gemm` gives the same bits)."""
        return self.bind_int8(packed, scales, n, x.shape[-1])(x)

    def bind(self, packed: torch.Tensor, n: int) -> PanelProduct:
        """The product with one float32 packed weight, checked now (its calls check only x)."""
        if packed.dtype != torch.float32:
            raise ValueError(f"the CPU gemm takes float32 panels, got {packed.dtype}")
        self._check_panels(packed, n, self.panel)
        return PanelProduct(self._gemm, (packed,), packed.shape[1], n)

    def bind_int8(self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> PanelProduct:
        """The product with one int8 packed weight of k inputs and its padded scales, checked now."""
        if packed.dtype != torch.int8 or scales.dtype != torch.float32:
            raise ValueError(
                f"the int8 gemm takes int8 panels and float32 scales, got {packed.dtype}, {scales.dtype}"
            )
        if scales.dim() != 1 or scales.shape[0] != packed.shape[0] * self.panel or not scales.is_contiguous():
            raise ValueError(f"scales {tuple(scales.shape)} do not fit panels {tuple(packed.shape)}")
        self._check_panels(packed, n, 2 * self.panel)
        if packed.shape[1] != -(-k // 2):
            raise ValueError(f"shapes do not fit: panels {tuple(packed.shape)} for {k} inputs")
        return PanelProduct(self._gemm_i8, (packed, scales), k, n)

    def bind_w8a8(self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> PanelProduct:
        """The w8a8 product with one pack_w8a8 weight of k inputs and its padded scales, checked now;
        refused where this CPU has no VNNI or past W8A8_MAX_K inputs."""
        if not self.vnni:
            raise ValueError("the w8a8 product needs VNNI (AVX-VNNI or AVX-512 VNNI) on this CPU")
        if k > W8A8_MAX_K:
            raise ValueError(f"the w8a8 product takes at most {W8A8_MAX_K} inputs, got {k}")
        if packed.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise ValueError(
                f"the w8a8 gemm takes uint8 panels and float32 scales, got {packed.dtype}, {scales.dtype}"
            )
        if scales.dim() != 1 or scales.shape[0] != packed.shape[0] * self.panel or not scales.is_contiguous():
            raise ValueError(f"scales {tuple(scales.shape)} do not fit panels {tuple(packed.shape)}")
        self._check_panels(packed, n, 4 * self.panel)
        if packed.shape[1] != -(-k // 4):
            raise ValueError(f"shapes do not fit: panels {tuple(packed.shape)} for {k} inputs")
        return PanelProduct(self._gemm_w8a8, (packed, scales), k, n)

    def _check_panels(self, packed: torch.Tensor, n: int, line: int) -> None:
        """Panels (ceil(n / panel), depth, line), contiguous, on the CPU."""
        if packed.device.type != "cpu":
            raise ValueError("the CPU gemm takes CPU tensors")
        if (
            packed.dim() != 3
            or packed.shape[2] != line
            or not 0 <= n <= packed.shape[0] * self.panel
            or n <= (packed.shape[0] - 1) * self.panel
        ):
            raise ValueError(f"shapes do not fit: panels {tuple(packed.shape)} for {n} outputs")
        if not packed.is_contiguous():
            raise ValueError("the CPU gemm takes contiguous tensors")

    def max_threads(self) -> int:
        """The threads one call runs on (torch's OpenMP runtime: torch.set_num_threads)."""
        return int(self._threads())


class PanelProduct:
    """`x @ w.T` for one packed weight whose panels were checked once (CpuGemm.bind / bind_int8): a
    call checks only x, which must be (rows, k) float32, contiguous, on the CPU. A decode step makes
    ~120 of these calls: the weight's checks cost more than the product of a small one."""

    __slots__ = ("_kernel", "_pointers", "_weight", "k", "n")

    def __init__(self, kernel: Any, weight: tuple[torch.Tensor, ...], k: int, n: int) -> None:
        # gemm_f32 (x, rows, k, packed, n, y) or gemm_i8 (x, rows, k, packed, scales, n, y)
        self._kernel = kernel
        self._weight = weight  # kept alive: the kernel reads them by address
        self._pointers = tuple(t.data_ptr() for t in weight)
        self.k, self.n = k, n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, k) -> (rows, n) float32."""
        if x.dtype != torch.float32:
            raise ValueError(f"the CPU gemm takes float32 activations, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"shapes do not multiply: x {tuple(x.shape)} @ a weight of {self.k} inputs")
        if not x.is_contiguous() or not x.is_cpu:
            raise ValueError("the CPU gemm takes contiguous CPU tensors")
        rows, k = x.shape
        y = torch.empty((rows, self.n), dtype=torch.float32)
        if rows and self.n and k:
            failed = self._kernel(x.data_ptr(), rows, k, *self._pointers, self.n, y.data_ptr())
            if failed == -1:
                raise MemoryError(f"no memory for the integer codes of a ({rows}, {k}) input")
            if failed:  # -2: w8a8 without VNNI, refused by bind_w8a8 already
                raise RuntimeError("the w8a8 product does not run on this CPU")
        elif rows and self.n:
            y.zero_()
        return y


def reference_int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `CpuGemm.int8` computes, bit for bit, in torch: x (rows, k) float32 rounded per row to
    int16 codes (scale max(max |x_row|, tiny) / 32767, half to even), exact integer sums with the
    (n, k) codes over chunks of 512 inputs, each chunk's sum added in float32 in order, then times the
    row's scale and the column's (n,) float32 scale. Rows holding a NaN or an infinity give NaN."""
    rows = x.float()
    row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 32767
    x_codes = torch.round(rows / row_scale).to(torch.int64)
    w_codes = codes.to(torch.int64)
    sums = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float32)
    for start in range(0, x.shape[1], 512):
        sums += (x_codes[:, start : start + 512] @ w_codes[:, start : start + 512].T).float()
    out = sums * row_scale * scales.float()
    bad = ~torch.isfinite(rows).all(dim=1)
    out[bad] = float("nan")
    return out
