"""Float32 weights packed for the C matrix product (kernels/cpu_gemm.c): a CPU model's projections
and LM head, in batch-invariant mode and without it.

A float32 model on the CPU spends most of a step in its products. MKL's sgemm reaches 90-150
GFLOP/s on our 2-core VMs (less at few rows, and a third of the memory bandwidth at one row); the
C kernel over weights laid out in 16-column panels reaches 150-175 from 16 rows on and the memory's
bandwidth at one row, and gives every row the same bits whatever the batch beside it, which is
what batch-invariant mode needs (MKL needs its strict mode and rows padded to a multiple of 4 for
that). `use_packed_weights` packs them once, after loading: each projection becomes a
`PackedWeight` (the same bytes, another order) that does its own product, as quantized weights do.
The LM head gets one too; a head tied to the embedding table is packed once and the token lookups
read their rows from the panels, so the table is not kept twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.quant import INT4_GROUP, PROJECTIONS, Int8Weight, W8A8Weight, replace_projections
from kernels import reference_quant
from kernels.cpu_gemm import W8A8_MAX_K, CpuGemm, PanelProduct, exactly_half

Tensor = torch.Tensor


@dataclass(frozen=True)
class PackedWeight:
    """An (out, in) float32 weight as kernels/cpu_gemm.py packs it: (ceil(out / 16), in, 16) panels."""

    packed: Tensor
    out_features: int
    gemm: CpuGemm
    product: PanelProduct  # the kernel's call for these panels, checked once

    @classmethod
    def pack(cls, weight: Tensor, gemm: CpuGemm) -> PackedWeight:
        """The weight's panels (the float weight itself is no longer needed)."""
        packed = gemm.pack(weight.detach())
        return cls(packed, weight.shape[0], gemm, gemm.bind(packed, weight.shape[0]))

    @property
    def shape(self) -> torch.Size:
        """The weight's shape (out, in)."""
        return torch.Size((self.out_features, self.packed.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes of the panels (the weight's, plus the last panel's padding)."""
        return self.packed.numel() * self.packed.element_size()

    def dequantize(self) -> Tensor:
        """The (out, in) float32 weight, unpacked (exact: packing only reorders)."""
        panels, width, panel = self.packed.shape
        return self.packed.transpose(1, 2).reshape(panels * panel, width)[: self.out_features]

    def rows(self, index: Tensor) -> Tensor:
        """Rows `index` of the weight (an embedding lookup in a table packed as the tied LM head)."""
        panel = self.packed.shape[2]
        return self.packed[index // panel, :, index % panel]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) float32 @ w.T (+ bias) -> (..., out)."""
        return _product(self.product, x, bias)


@dataclass(frozen=True)
class PackedInt8Weight:
    """A per-channel int8 weight (engine/layers/quant.py's Int8Weight) as int8 panels and float32
    scales for the same kernel: each row of activations rounded to int16 codes with its own scale
    and multiplied in exact integer sums (a quarter of float32's bytes at a few rows, twice its
    products per instruction where products are compute-bound), each row on its own
    (batch-invariant). kernels/cpu_gemm.py's `reference_int8_gemm` is its exact reference."""

    packed: Tensor  # (ceil(out / 16), ceil(in / 2), 32) int8
    scales: Tensor  # (ceil(out / 16) * 16,) float32, zeros past out
    out_features: int
    in_features: int
    gemm: CpuGemm
    product: PanelProduct  # the kernel's call for these panels and scales, checked once

    @classmethod
    def of(cls, weight: Int8Weight, gemm: CpuGemm) -> PackedInt8Weight:
        """The same codes and scales, packed."""
        out_features, in_features = weight.shape
        packed, scales = gemm.pack_int8(weight.qweight), gemm.pack_scales(weight.scales)
        product = gemm.bind_int8(packed, scales, out_features, in_features)
        return cls(packed, scales, out_features, in_features, gemm, product)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales."""
        return self.packed.numel() + 4 * self.scales.numel()

    def codes(self) -> Tensor:
        """The (out, in) int8 codes, unpacked."""
        return self.gemm.unpack_int8(self.packed, self.out_features, self.in_features)

    def dequantize(self) -> Tensor:
        """The float32 weight these codes stand for."""
        return self.codes().float() * self.scales[: self.out_features, None]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) @ w.T (+ bias) -> (..., out) in x's dtype (computed from float32 activations)."""
        return _product(self.product, x, bias)


@dataclass(frozen=True)
class PackedInt4Weight:
    """A 4-bit weight in groups of inputs, w = q * d + m (q in 0..15, d and m per output and group:
    GGUF Q4_1's form, and AWQ's and GPTQ's grids exactly), as panels for the C product: each row of
    activations rounded to int16 codes, exact integer sums per group, each row on its own
    (batch-invariant). kernels/cpu_gemm.py's `reference_int4_gemm` is its exact reference. d and m
    are stored as float16 where every one of them is a float16 value (Q4_1's blocks, the default
    model's: 5/8 of a byte a weight, Q4_1's own size), else as float32 (3/4 of a byte); int8 takes 1.
    Unlike torch's int4 kernel, neither bfloat16 activations nor bfloat16 scales."""

    packed: Tensor  # (ceil(out / 16), in / group, 8 * group + 64 or 128) uint8
    out_features: int
    in_features: int
    group: int
    gemm: CpuGemm
    product: PanelProduct
    input_perm: Tensor | None = None  # GPTQ act-order: the packed columns are x[..., input_perm]'s

    @classmethod
    def quantize(cls, weight: Tensor, gemm: CpuGemm, group: int = INT4_GROUP) -> PackedInt4Weight:
        """Asymmetric 4-bit over each group's range (kernels/reference_quant.py's
        quantize_int4_groups). A weight that came from Q4_1 blocks of `group` (the default model)
        gets its own blocks back: the float16 scales and offsets that rebuild every weight exactly
        (q * d + m in float32, as GGUF's dequantization computes it), where the rounded ones do."""
        q, scale, low = reference_quant.quantize_int4_groups(weight, group)
        d, m = scale.half().float(), low.half().float()
        rebuilt = q.float().view(q.shape[0], -1, group) * d[..., None] + m[..., None]
        if torch.equal(rebuilt.view(q.shape), weight.detach().float()):
            scale, low = d, m
        return cls.of(q, scale, low, group, gemm)

    @classmethod
    def from_grid(
        cls, q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor, group_size: int, gemm: CpuGemm
    ) -> PackedInt4Weight:
        """A checkpoint's own 4-bit values (AWQ, GPTQ), w = (q - zero) * scale: d = scale and
        m = -zero * scale in float32. q (out, in) in 0..15; zeros, scales (out, groups); g_idx (in,)
        each input's group (act-order checkpoints permute them: the inputs are reordered)."""
        perm = reference_quant.group_order(g_idx, group_size)
        if perm is not None:
            q = q[:, perm]
        d = scales.float()
        return cls.of(q, d, -zeros.float() * d, group_size, gemm, perm)

    @classmethod
    def of(
        cls, q: Tensor, d: Tensor, m: Tensor, group: int, gemm: CpuGemm, perm: Tensor | None = None
    ) -> PackedInt4Weight:
        """Values q (out, in) in 0..15 with scales d and offsets m (out, in / group), packed (d and
        m as float16 where they are float16 values exactly and the CPU converts them)."""
        out_features, in_features = q.shape
        half = gemm.half_scales and exactly_half(d) and exactly_half(m)
        packed = gemm.pack_int4(q, d, m, group, half)
        product = gemm.bind_int4(packed, out_features, in_features, group)
        return cls(packed, out_features, in_features, group, gemm, product, perm)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        """Bytes of the values, scales and offsets."""
        return self.packed.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight (out, in) these values stand for, in the checkpoint's input order."""
        q, d, m = self.gemm.unpack_int4(self.packed, self.out_features, self.group)
        w = q.float() * d.repeat_interleave(self.group, 1) + m.repeat_interleave(self.group, 1)
        return reference_quant.in_checkpoint_order(w, self.input_perm)

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) @ w.T (+ bias) -> (..., out) in x's dtype (computed from float32 activations)."""
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return _product(self.product, x, bias)


@dataclass(frozen=True)
class PackedW8A8Weight:
    """w8a8's weight (engine/layers/quant.py's W8A8Weight) with a second layout of its codes for the
    C product. Where the CPU has VNNI: up to FEW_ROWS rows (decode steps) the C kernel's dpbusd
    (2.8-3.6x float32's product, 1.1-6.5x torch._int_mm's at 1-16 rows), past them torch._int_mm
    (faster there: oneDNN's larger tiles). Without VNNI the C product takes every row count:
    torch._int_mm is oneDNN's reference loop there (15.7 ms for 32 rows of a 576 -> 960 projection
    on a Zen 3 VM's two cores, 40x float32's product). Both are exact int32 sums with the same float
    steps after, so they give the same bits and the engine stays batch-invariant. Costs one more
    byte a weight."""

    FEW_ROWS = 16

    weight: W8A8Weight
    packed: Tensor  # VNNI: (ceil(out / 16), ceil(in / 4), 64) uint8, the codes + 128; else pack_int8's
    scales: Tensor  # (ceil(out / 16) * 16,) float32
    product: PanelProduct
    row_limit: int | None  # the most rows the C product takes (None: any), torch._int_mm past it

    @classmethod
    def of(cls, weight: W8A8Weight, gemm: CpuGemm) -> PackedW8A8Weight:
        """The same codes and scales, also packed for the C product."""
        out_features, in_features = weight.shape
        packed = gemm.pack_w8a8(weight.qweight.t())
        scales = gemm.pack_scales(weight.scales)
        product = gemm.bind_w8a8(packed, scales, out_features, in_features)
        return cls(weight, packed, scales, product, cls.FEW_ROWS if gemm.vnni else None)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes of both layouts and the scales."""
        return self.weight.nbytes + self.packed.numel() + 4 * self.scales.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight these codes stand for."""
        return self.weight.dequantize()

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) @ w.T (+ bias) in x's dtype: each row quantized to int8 by its own maximum."""
        if self.row_limit is not None and x.numel() > self.row_limit * x.shape[-1]:
            return self.weight.matmul(x, bias)
        return _product(self.product, x, bias)


def _product(product: PanelProduct, x: Tensor, bias: Tensor | None) -> Tensor:
    """product(x) over x's last dimension, in x's dtype (+ bias). A decode step makes ~120 of these
    calls: the common case (2-D contiguous float32) takes no reshape, conversion or copy."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.dtype != torch.float32:
        flat = flat.float()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = product(flat)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], out.shape[-1])
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if bias is None else out + bias


def stack_product(weight: object) -> tuple[PanelProduct, int | None] | None:
    """The C product that computes `weight`'s matmul for a float32 2-D x without bias (what
    kernels/cpu_stack.c may call in its place) and the most rows it should take it for (None: any),
    or None where the weight's product is not one C call: an MKL or torch weight, or int4 whose
    inputs are permuted first (act-order)."""
    if isinstance(weight, (PackedWeight, PackedInt8Weight)):
        return weight.product, None
    if isinstance(weight, PackedInt4Weight):
        return (weight.product, None) if weight.input_perm is None else None
    if isinstance(weight, PackedW8A8Weight):  # the same bits past row_limit, where torch._int_mm is faster
        return weight.product, weight.row_limit
    return None


def use_packed_int8(model: nn.Module, gemm: CpuGemm) -> int:
    """Every Int8Weight of the model (int8's projections and LM head, w8a8's output and down
    projections, int4's head) becomes a PackedInt8Weight, and every W8A8Weight (w8a8's QKV and
    gate/up) of up to W8A8_MAX_K inputs a PackedW8A8Weight; returns how many."""
    swapped = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if type(value) is Int8Weight:
                setattr(module, name, PackedInt8Weight.of(value, gemm))
                swapped += 1
            elif type(value) is W8A8Weight and value.shape[1] <= W8A8_MAX_K:
                setattr(module, name, PackedW8A8Weight.of(value, gemm))
                swapped += 1
    return swapped


def rows_alone(model: nn.Module) -> bool:
    """Whether every product of the model (projections and LM head) is one of the C kernel's over
    packed weights, which compute each row on its own: a batch-invariant step then needs no rows
    padded to MKL's row multiple."""
    for module in model.modules():
        for name in PROJECTIONS.get(type(module).__name__, ()):
            if not _alone(getattr(module, name)):
                return False
    return _alone(getattr(model, "head_weight", None))


def _alone(weight: object) -> bool:
    """Whether the weight's every product is a C kernel's (w8a8: where no row count goes to torch)."""
    if isinstance(weight, PackedW8A8Weight):
        return weight.row_limit is None
    return isinstance(weight, (PackedWeight, PackedInt8Weight, PackedInt4Weight))


def use_packed_weights(model: nn.Module, gemm: CpuGemm) -> int:
    """Pack a float32 model's projections and LM head in place (engine/models/llama.py's
    LlamaForCausalLM); returns the bytes they take."""
    total = replace_projections(model, lambda _name, weight: PackedWeight.pack(weight, gemm))
    llama: Any = model
    if llama.lm_head is not None:  # untied: the head's float weight is no longer read
        head = PackedWeight.pack(llama.lm_head, gemm)
        del llama.lm_head
        llama.lm_head = None
    else:  # tied: the lookups read the head's panels instead of a second copy of the table
        head = PackedWeight.pack(llama.embed_tokens, gemm)
        del llama.embed_tokens
        llama.embed_tokens = None
    llama.head_weight = head
    return total + head.nbytes
