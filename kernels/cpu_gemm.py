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

`pack_w8a8` and `bind_w8a8` are w8a8's product: each row of x rounded to int8 codes (max |x| / 127)
times int8 codes in exact int32 sums, bit for bit what torch._int_mm gives on the same codes
(engine/layers/quant.py's W8A8Weight). Where the CPU has VNNI, four products per lane and
instruction (dpbusd) over codes + 128 in quads; elsewhere `pack_int8`'s panels and the int8 tiles
over int16-held codes, one sum over all of k (torch._int_mm has no fast path there: oneDNN's
reference loop, ~30x float32's time at 32 rows).

`pack_int4` lays 4-bit weights in groups out (w = q * d + m per column and group of inputs, q in
0..15, float32 d and m: GGUF Q4_1's form, and any asymmetric or symmetric 4-bit grid's; float16 d
and m where they are float16 values exactly, as Q4_1's own are: 5 bits a weight instead of 6);
`bind_int4` rounds each row of x to int16 codes as the int8 product does, takes each group's exact
integer sum and adds sum * d + m * (the group's sum of codes) in float32, group after group: again
each row on its own. Its exact reference is `reference_int4_gemm`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P, _L = ctypes.c_void_p, ctypes.c_long
W8A8_MAX_K = 65536  # cpu_gemm.c's: one int32 sum per output stays below 2^31 up to it
INT4_MAX_GROUP = 4096  # cpu_gemm.c's Q4_MAX_GROUP: one group's int32 sum stays below 2^31 up to it
# a PanelProduct's kernel (cpu_stack.c's STACK_* names the same numbers); Q4H: int4 with float16
# scales and offsets
F32, I8, W8A8, Q4, Q4H = 0, 1, 2, 3, 4


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
        self._gemm_q4 = library.gemm_q4  # (x, rows, k, packed, group, n, y)
        self._gemm_q4.argtypes = [_P, _L, _L, _P, _L, _L, _P]
        self._gemm_q4.restype = ctypes.c_int
        self._gemm_q4h = library.gemm_q4h  # gemm_q4's arguments
        self._gemm_q4h.argtypes = [_P, _L, _L, _P, _L, _L, _P]
        self._gemm_q4h.restype = ctypes.c_int
        self._threads = library.gemm_max_threads
        self._threads.restype = ctypes.c_int
        self.panel = int(library.gemm_panel_width())
        self.vectorized = bool(library.gemm_vectorized())  # False: correct scalar sums, too slow to use
        self.vnni = bool(library.gemm_vnni())  # False: w8a8 panels hold pairs of signed codes here
        self.half_scales = bool(library.gemm_half_scales())  # False: int4 keeps float32 scales here

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
        """(n, k) int8 codes -> where this CPU has VNNI, (ceil(n / panel), ceil(k / 4), 4 * panel) uint8
        codes + 128: each line four consecutive inputs of the panel's columns, 128 (code 0) past row n
        and column k; elsewhere `pack_int8`'s panels (the signed codes in pairs)."""
        if codes.dtype != torch.int8 or codes.dim() != 2 or codes.device.type != "cpu":
            raise ValueError(f"packs 2-D int8 CPU codes, got {tuple(codes.shape)} {codes.dtype}")
        if not self.vnni:
            return self.pack_int8(codes)
        n, k = codes.shape
        panels, quads = -(-n // self.panel), -(-k // 4)
        padded = codes.new_zeros(panels * self.panel, 4 * quads)
        padded[:n, :k] = codes
        lines = padded.view(panels, self.panel, quads, 4).permute(0, 2, 1, 3)
        return (lines.reshape(panels, quads, 4 * self.panel).view(torch.uint8) ^ 0x80).contiguous()

    def pack_int4(
        self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int, half: bool = False
    ) -> torch.Tensor:
        """(n, k) 4-bit values q (0..15, any integer dtype) with scales d and offsets m (n, k / group)
        -> (ceil(n / panel), k / group, 8 * group + 8 * panel) uint8: per panel and group, the
        nibbles (a quad of inputs of the panel's columns in 32 bytes: byte 2j + u holds column j's
        input 4s + u low and 4s + 2 + u high), then the panel's 16 d and 16 m as float32 bytes.
        `half`: d and m as float16 (4 * panel bytes, GGUF Q4_1's own form), where every d and m is
        a float16 value exactly (refused otherwise) and this CPU has the product for it."""
        n, k = q.shape
        if q.dim() != 2 or q.device.type != "cpu" or q.dtype.is_floating_point:
            raise ValueError(f"packs 2-D integer CPU values, got {tuple(q.shape)} {q.dtype}")
        if group <= 0 or group % 4 or group > INT4_MAX_GROUP or k % group:
            raise ValueError(
                f"int4 groups must be a multiple of 4 up to {INT4_MAX_GROUP} dividing {k}, got {group}"
            )
        groups = k // group
        if d.shape != (n, groups) or m.shape != (n, groups):
            raise ValueError(
                f"scales {tuple(d.shape)} and offsets {tuple(m.shape)} do not fit {n} x {groups} groups"
            )
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("4-bit values must lie in 0..15")
        if half and not self.half_scales:
            raise ValueError("float16 scales need F16C on this CPU")
        if half and not (exactly_half(d) and exactly_half(m)):
            raise ValueError("float16 scales and offsets must hold d and m exactly")
        panels = -(-n // self.panel)
        values = torch.zeros(panels * self.panel, k, dtype=torch.uint8)
        values[:n] = q.to(torch.uint8)
        # (panels, column, group, quad, half, u): half 0 -> low nibble, 1 -> high nibble
        split = values.view(panels, self.panel, groups, group // 4, 2, 2)
        nibbles = split[..., 0, :] | (split[..., 1, :] << 4)  # (panels, column, group, quad, u)
        nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(panels, groups, group // 4 * 2 * self.panel)
        floats = torch.zeros(2, panels * self.panel, groups, dtype=torch.float16 if half else torch.float32)
        floats[0, :n], floats[1, :n] = d, m
        # (2, panels, column, group) -> (panels, group, 2, column) as bytes
        tail = floats.view(2, panels, self.panel, groups).permute(1, 3, 0, 2).contiguous()
        return torch.cat((nibbles, tail.view(panels, groups, 2 * self.panel).view(torch.uint8)), dim=2)

    def unpack_int4(
        self, packed: torch.Tensor, n: int, group: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (n, k) values (uint8) and (n, k / group) float32 d and m `pack_int4` laid out (with
        float32 or float16 scales: the line's width says which)."""
        panels, groups, line = packed.shape
        quads = group // 4
        nibbles = packed[..., : quads * 2 * self.panel].reshape(panels, groups, quads, self.panel, 2)
        halves = torch.stack((nibbles & 15, nibbles >> 4), dim=4)  # (panels, group, quad, column, half, u)
        q = halves.permute(0, 3, 1, 2, 4, 5).reshape(panels * self.panel, groups * group)[:n]
        half = line == 8 * group + 4 * self.panel
        scale_dtype = torch.float16 if half else torch.float32
        tail = packed[..., quads * 2 * self.panel :].contiguous().view(scale_dtype)
        floats = (
            tail.view(panels, groups, 2, self.panel)
            .permute(2, 0, 3, 1)
            .reshape(2, panels * self.panel, groups)
            .float()
        )
        return q.contiguous(), floats[0, :n].contiguous(), floats[1, :n].contiguous()

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
        return PanelProduct(self._gemm, F32, (packed,), packed.shape[1], n)

    def bind_int8(self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> PanelProduct:
        """The product with one int8 packed weight of k inputs and its padded scales, checked now."""
        if packed.dtype != torch.int8 or scales.dtype != torch.float32:
            raise ValueError(
                f"the int8 gemm takes int8 panels and float32 scales, got {packed.dtype}, {scales.dtype}"
            )
        self._check_scaled_panels(packed, scales, n, k, 2)
        return PanelProduct(self._gemm_i8, I8, (packed, scales), k, n)

    def bind_w8a8(self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> PanelProduct:
        """The w8a8 product with one pack_w8a8 weight of k inputs and its padded scales, checked now;
        refused past W8A8_MAX_K inputs (its int32 sums could overflow)."""
        if k > W8A8_MAX_K:
            raise ValueError(f"the w8a8 product takes at most {W8A8_MAX_K} inputs, got {k}")
        dtype = torch.uint8 if self.vnni else torch.int8  # pack_w8a8's layout on this CPU
        if packed.dtype != dtype or scales.dtype != torch.float32:
            raise ValueError(
                f"the w8a8 gemm takes {dtype} panels and float32 scales here, "
                f"got {packed.dtype}, {scales.dtype}"
            )
        self._check_scaled_panels(packed, scales, n, k, 4 if self.vnni else 2)
        return PanelProduct(self._gemm_w8a8, W8A8, (packed, scales), k, n)

    def bind_int4(self, packed: torch.Tensor, n: int, k: int, group: int) -> PanelProduct:
        """The product with one pack_int4 weight of k inputs in groups of `group` (float32 or float16
        scales: the line's width says which), checked now."""
        if packed.dtype != torch.uint8:
            raise ValueError(f"the int4 gemm takes uint8 panels, got {packed.dtype}")
        if (
            group <= 0
            or group % 4
            or group > INT4_MAX_GROUP
            or k % group
            or packed.shape[1:2] != (k // group,)
        ):
            raise ValueError(
                f"shapes do not fit: panels {tuple(packed.shape)} for {k} inputs in groups of {group}"
            )
        half = packed.dim() == 3 and packed.shape[2] == 8 * group + 4 * self.panel
        if half and not self.half_scales:
            raise ValueError("float16 scales need F16C on this CPU")
        self._check_panels(packed, n, 8 * group + (4 if half else 8) * self.panel)
        if half:
            return PanelProduct(self._gemm_q4h, Q4H, (packed,), k, n, group)
        return PanelProduct(self._gemm_q4, Q4, (packed,), k, n, group)

    def _check_scaled_panels(
        self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int, per_line: int
    ) -> None:
        """Integer panels holding `per_line` consecutive inputs a line (int8: 2, w8a8: 4) for k inputs
        and n outputs, with per-channel scales padded to the panels' width."""
        if scales.dim() != 1 or scales.shape[0] != packed.shape[0] * self.panel or not scales.is_contiguous():
            raise ValueError(f"scales {tuple(scales.shape)} do not fit panels {tuple(packed.shape)}")
        self._check_panels(packed, n, per_line * self.panel)
        if packed.shape[1] != -(-k // per_line):
            raise ValueError(f"shapes do not fit: panels {tuple(packed.shape)} for {k} inputs")

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

    __slots__ = ("_kernel", "_pointers", "_weight", "k", "kind", "n")

    def __init__(
        self, kernel: Any, kind: int, weight: tuple[torch.Tensor, ...], k: int, n: int, *extra: int
    ) -> None:
        # gemm_f32 (x, rows, k, packed, n, y), gemm_i8 / gemm_w8a8 (x, rows, k, packed, scales, n, y)
        # or gemm_q4 (x, rows, k, packed, group, n, y): `extra` are the integers after the tensors
        self._kernel = kernel
        self.kind = kind  # F32, I8, W8A8, Q4 or Q4H
        self._weight = weight  # kept alive: the kernel reads them by address
        self._pointers = (*(t.data_ptr() for t in weight), *extra)
        self.k, self.n = k, n

    @property
    def weight(self) -> tuple[torch.Tensor, ...]:
        """The packed tensors the kernel reads (panels; int8 and w8a8: then the scales)."""
        return self._weight

    @property
    def group(self) -> int:
        """Q4, Q4H: the inputs a group of the weight; 0 for the other kinds."""
        return int(self._pointers[-1]) if self.kind in (Q4, Q4H) else 0

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
            if failed:  # -2: w8a8 past W8A8_MAX_K, int4 groups that do not fit: refused when bound
                raise RuntimeError("the product does not run on this CPU or for these shapes")
        elif rows and self.n:
            y.zero_()
        return y


def exactly_half(values: torch.Tensor) -> bool:
    """Whether every value is a float16 value exactly (so float16 storage keeps it)."""
    as_float = values.float()
    return bool(torch.equal(as_float.half().float(), as_float))


def reference_int8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `CpuGemm.int8` computes, bit for bit, in torch: x (rows, k) float32 rounded per row to
    int16 codes (scale max(max |x_row| / 32767, tiny), half to even), exact integer sums with the
    (n, k) codes over chunks of 512 inputs, each chunk's sum added in float32 in order, then times the
    row's scale and the column's (n,) float32 scale. Rows holding a NaN or an infinity give NaN."""
    rows = x.float()
    row_scale = (rows.abs().amax(dim=1, keepdim=True) / 32767).clamp(min=torch.finfo(torch.float32).tiny)
    x_codes = torch.round(rows / row_scale).to(torch.int64)
    w_codes = codes.to(torch.int64)
    sums = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float32)
    for start in range(0, x.shape[1], 512):
        sums += (x_codes[:, start : start + 512] @ w_codes[:, start : start + 512].T).float()
    out = sums * row_scale * scales.float()
    bad = ~torch.isfinite(rows).all(dim=1)
    out[bad] = float("nan")
    return out


def reference_int4_gemm(
    x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int
) -> torch.Tensor:
    """What `CpuGemm.bind_int4`'s product computes, bit for bit, in torch: x (rows, k) rounded per
    row to int16 codes (as `reference_int8_gemm`), then for each group of `group` inputs in order
    y = fma(float(sum of q * codes), d, y) and y = fma(m, float(sum of codes), y) (each fused
    multiply-add computed in float64 and rounded once to float32), then y times the row's scale;
    q (n, k) in 0..15, d and m (n, k / group) float32. Rows holding a NaN or an infinity give NaN."""
    rows = x.float()
    row_scale = (rows.abs().amax(dim=1, keepdim=True) / 32767).clamp(min=torch.finfo(torch.float32).tiny)
    x_codes = torch.round(rows / row_scale).to(torch.int64)
    w = q.to(torch.int64)
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32)
    for g in range(x.shape[1] // group):
        span = slice(g * group, (g + 1) * group)
        sums = (x_codes[:, span] @ w[:, span].T).float().double()
        code_sums = x_codes[:, span].sum(dim=1, keepdim=True).float().double()
        out = (sums * d[:, g].double() + out.double()).float()
        out = (m[:, g].double() * code_sums + out.double()).float()
    out = out * row_scale
    bad = ~torch.isfinite(rows).all(dim=1)
    out[bad] = float("nan")
    return out
