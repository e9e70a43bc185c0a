"""Quantized weights for the Triton backend (the GPU path): the layouts kernels/quant_matmul.py reads.

- `TritonInt4Weight`: 4-bit values packed along the inputs (K / 8, N) with a float32 scale and
  offset per group of inputs and output (w = q * scale + offset). From a checkpoint's grid
  (AWQ, GPTQ, act-order included) the values are kept as they are, and scales and offsets are
  exact (offset = -zero * scale in float32); quantized at load, groups of 128 inputs (64 or 32
  when the rows are shorter), asymmetric over each group's range.
- `TritonInt8Weight`: int8 rows with a float32 scale each (symmetric, as the CPU form).
The LM head keeps the model's dtype unless quantized at load (int8 then, as on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference_quant

Tensor = torch.Tensor


def _group_for(in_features: int) -> int:
    group = next((g for g in (128, 64, 32) if in_features % g == 0), None)
    if group is None:
        raise ValueError(f"int4 needs rows of a multiple of 32 inputs, got {in_features}")
    return group


@dataclass(frozen=True)
class TritonInt4Weight:
    """An (out, in) weight as 4-bit groups for the Triton int4 matmul."""

    qweight: Tensor  # (in / 8, out) int32
    scales: Tensor  # (in / group_size, out) float32
    offsets: Tensor  # (in / group_size, out) float32
    group_size: int
    shape: torch.Size  # (out, in)
    input_perm: Tensor | None = None  # act-order: the inputs in group order

    @classmethod
    def from_grid(
        cls, q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor, group_size: int, device: torch.device
    ) -> TritonInt4Weight:
        """A checkpoint's grid: q (out, in) in 0..15, zeros and scales (out, groups), g_idx (in,)."""
        out_features, in_features = q.shape
        perm = reference_quant.group_order(g_idx, group_size)
        if perm is not None:
            q = q[:, perm]
        s = scales.float()
        return cls(
            reference_quant.pack_int4(q).to(device),
            s.t().contiguous().to(device),
            (-zeros.float() * s).t().contiguous().to(device),
            group_size,
            torch.Size((out_features, in_features)),
            None if perm is None else perm.to(device),
        )

    @classmethod
    def quantize(cls, weight: Tensor) -> TritonInt4Weight:
        """Asymmetric 4-bit over each group's range [low, high]: q = round((w - low) / scale)."""
        group = _group_for(weight.shape[1])
        q, scale, low = reference_quant.quantize_int4_groups(weight, group)
        packed = reference_quant.pack_int4(q.cpu()).to(weight.device)
        return cls(packed, scale.t().contiguous(), low.t().contiguous(), group, weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed values, scales and offsets."""
        return 4 * (self.qweight.numel() + self.scales.numel() + self.offsets.numel())

    def dequantize(self) -> Tensor:
        """The float32 weight (out, in) these values stand for, in the checkpoint's input order."""
        w = reference_quant.int4_weight(self.qweight, self.scales, self.offsets, self.group_size)
        return reference_quant.in_checkpoint_order(w, self.input_perm)

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) in x's dtype."""
        from kernels.quant_matmul import int4_matmul

        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        out = int4_matmul(x, self.qweight, self.scales, self.offsets, self.group_size)
        return out if bias is None else out + bias


@dataclass(frozen=True)
class TritonInt8Weight:
    """An (out, in) weight as int8 rows, one float32 scale each, for the Triton int8 matmul."""

    qweight: Tensor  # (out, in) int8
    scales: Tensor  # (out,) float32

    @classmethod
    def quantize(cls, weight: Tensor) -> TritonInt8Weight:
        """Symmetric per output channel: scale = max |w_row| / 127."""
        q, scale = reference_quant.quantize_int8_rows(weight)
        return cls(q.contiguous(), scale)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the values and scales."""
        return self.qweight.numel() + 4 * self.scales.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight these values stand for."""
        return self.qweight.float() * self.scales[:, None]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) in x's dtype."""
        from kernels.quant_matmul import int8_matmul

        out = int8_matmul(x, self.qweight, self.scales)
        return out if bias is None else out + bias
