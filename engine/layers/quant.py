"""Quantization at load time (`quantization="int8"`, `"int4"`, `"w8a8"`): the CPU forms, and the
one place a model's projections are replaced (`replace_projections`; the Triton backend's forms
are in quant_triton.py, which form a checkpoint gets in weight_loading.py).

Decode reads every weight once per step, so fewer bytes are most of the speed. Each projection
(QKV, output, gate/up, down) becomes
- int8 (`Int8Weight`): one scale per output channel (symmetric, w ≈ q * s, s = max|w_row| / 127),
  through torch's packed-int8 matmul (`aten._weight_int8pack_mm`);
- int4 (`Int4Weight`): groups of 32 inputs with a scale and a zero each, through torch's int4 CPU
  matmul (`aten._weight_int4pack_mm_for_cpu`). 32 is GGUF's 4-bit block: the default model ships
  as a 4-bit GGUF, so int4 gives it back its own values.
The LM head is int8 in both (every logit of the vocabulary reads it). Both kernels take bfloat16
activations (their float32-activation variants are ~10x slower here; bfloat16 moves perplexity by
0.01%) and compute each row on its own, so a quantized engine stays batch-invariant.

Where the C product over packed weights builds (x86 with AVX2 and FMA: kernels/cpu_gemm.c), the
engine then moves every Int8Weight to it after loading (engine/layers/packed.py's
`PackedInt8Weight`: activations rounded to int16 per row, exact integer sums, each row on its own;
faster than torch's int8 kernel at every row count and than the float32 product from a few rows
on), in both modes; and int4 is made for the C kernel's own int4 product at load time instead
(packed.py's `PackedInt4Weight`: float32 scale and offset per group, so the default model's Q4_1
values come back to float32's rounding). The default model's figures are in docs/quantization.md.

- w8a8 (`W8A8Weight`, QKV and gate/up only): int8 weights times int8 activations with one scale per
  row, through torch's integer matmul; several times faster for batches where the CPU has VNNI
  (see the class). There, decode steps' few rows take the C kernel's product instead; without VNNI
  (torch's product is then oneDNN's slow reference loop) every row count does (packed.py's
  `PackedW8A8Weight`, the same bits).

The embedding table stays in the model's dtype for the lookups (tied to the LM head, the head gets
its own int8 copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from engine.config import QUANTIZATIONS
from engine.layers.quant_triton import TritonInt4Weight, TritonInt8Weight
from kernels import reference_quant

Tensor = torch.Tensor
_QMAX = 127
# int4 groups: 32 inputs, the block of GGUF's 4-bit formats, so that the default model (shipped as
# a 4-bit GGUF) comes back to its own values; finer groups cost 4 bytes of scale and zero per 16
INT4_GROUP = 32
_QUANTIZE_ROWS = 1024  # rows quantized at a time (an LM head's 49,152 x 576: 7x faster than at once)


@dataclass(frozen=True)
class Int8Weight:
    """An (out, in) weight as int8 values and one bfloat16 scale per output channel."""

    qweight: Tensor  # (out, in) int8, contiguous
    scales: Tensor  # (out,) bfloat16

    @classmethod
    def quantize(cls, weight: Tensor) -> Int8Weight:
        """Round to the nearest step of each row's scale; the scale is rounded up to bfloat16 first,
        so that the stored scale is the one the values were rounded with and none exceeds 127."""
        w = weight.detach().float()
        rows = range(0, w.shape[0], _QUANTIZE_ROWS)  # a slice at a time: its temporaries stay in cache
        amax = torch.cat([w[r : r + _QUANTIZE_ROWS].abs().amax(dim=1) for r in rows])
        stored = _bf16_at_least(amax / _QMAX)
        scale = stored.float()[:, None]
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        for r in rows:
            q[r : r + _QUANTIZE_ROWS] = (
                (w[r : r + _QUANTIZE_ROWS] / scale[r : r + _QUANTIZE_ROWS]).round_().clamp_(-_QMAX, _QMAX)
            )
        return cls(q, stored)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the values and scales."""
        return self.qweight.numel() + 2 * self.scales.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight these values stand for."""
        return self.qweight.float() * self.scales.float()[:, None]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) in x's dtype, from bfloat16 activations and float32 accumulation."""
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out: Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


@dataclass(frozen=True)
class W8A8Weight:
    """Int8 weights (one scale per output channel) times int8 activations (one scale per row,
    from the row's own maximum, at each product): torch's integer matmul accumulates exactly in
    int32, so a row's result never depends on the other rows (batch-invariant), and from a few
    rows on it runs several times faster than the float or weight-only kernels on a CPU with VNNI
    (without, it is ~30x slower: the engine's C product replaces it, packed.py)."""

    qweight: Tensor  # (in, out) int8: the (out, in) codes transposed, as torch._int_mm reads them
    scales: Tensor  # (out,) float32

    @classmethod
    def quantize(cls, weight: Tensor) -> W8A8Weight:
        """Symmetric per output channel: scale = max |w_row| / 127."""
        q, scale = reference_quant.quantize_int8_rows(weight)
        return cls(q.t().contiguous(), scale)

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape (out, in)."""
        return torch.Size((self.qweight.shape[1], self.qweight.shape[0]))

    @property
    def nbytes(self) -> int:
        """Bytes of the values and scales."""
        return self.qweight.numel() + 4 * self.scales.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight these values stand for."""
        return self.qweight.t().float() * self.scales[:, None]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) in x's dtype: each row quantized to int8 by its own maximum."""
        rows = x.reshape(-1, x.shape[-1]).float()
        # a normal float: a subnormal scale keeps a few bits, and a code could pass 127 (and wrap)
        row_scale = (rows.abs().amax(dim=1, keepdim=True) / _QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
        codes = torch.round(rows / row_scale).to(torch.int8)
        out = torch._int_mm(codes, self.qweight).float().mul_(row_scale).mul_(self.scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


@dataclass(frozen=True)
class Int4Weight:
    """An (out, in) weight as 4-bit values in groups of `group_size` inputs along a row, each group
    with a bfloat16 scale and zero (w ≈ (q - 8) * scale + zero, q in 0..15), packed for torch's
    int4 CPU matmul."""

    packed: Tensor  # (out, in / 2) uint8, torch's CPU int4 packing
    scales_and_zeros: Tensor  # (in / group_size, out, 2) bfloat16
    group_size: int
    shape: torch.Size  # the float weight's (out, in)
    # GPTQ act-order: the inputs in group order (the packed columns are x[..., input_perm]'s)
    input_perm: Tensor | None = None

    @classmethod
    def from_grid(
        cls, q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor, group_size: int
    ) -> Int4Weight:
        """A checkpoint's own 4-bit values (AWQ, GPTQ): w = (q - zero) * scale per group, kept as they
        are; only the scales and zeros round to bfloat16 (zero' = (8 - zero) * scale).

        q: (out, in) in 0..15; zeros, scales: (out, groups); g_idx: (in,) the group of each input,
        `group_size` members each (act-order checkpoints permute them: the inputs are reordered)."""
        out_features, in_features = q.shape
        perm = reference_quant.group_order(g_idx, group_size)
        if perm is not None:
            q = q[:, perm]
        # the kernel takes groups of 32 to 256: a larger group is several of them sharing one scale
        kernel_group = next((g for g in (256, 128, 64, 32) if group_size % g == 0), None)
        if kernel_group is None or out_features % 16 or in_features % kernel_group:
            raise ValueError(
                f"int4 kernels need groups of 32..256 and outputs in 16s, got {group_size}, {tuple(q.shape)}"
            )
        repeat = group_size // kernel_group
        scale = scales.float().repeat_interleave(repeat, dim=1)
        zero = ((8 - zeros.float()) * scales.float()).repeat_interleave(repeat, dim=1)
        pairs = torch.stack((scale, zero), dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        return cls(packed, pairs, kernel_group, torch.Size((out_features, in_features)), perm)

    @classmethod
    def quantize(cls, weight: Tensor, group_size: int | None = None) -> Int4Weight:
        """Asymmetric 4-bit per group of `group_size` (default 32) inputs."""
        out_features, in_features = weight.shape
        group = group_size or INT4_GROUP
        if in_features % group:
            raise ValueError(f"int4 in groups of {group} needs rows of a multiple of it, got {in_features}")
        w = weight.detach().float().reshape(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = _bf16_at_least((high - low) / 15)
        zero = (low + 8 * scale.float()).to(torch.bfloat16)
        base = zero.float() - 8 * scale.float()  # what q = 0 stands for
        q = torch.round((w - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
        values = q.to(torch.int32).reshape(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
        pairs = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
        return cls(packed, pairs, group, weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed values, scales and zeros."""
        return self.packed.numel() + 2 * self.scales_and_zeros.numel()

    def dequantize(self) -> Tensor:
        """The float32 weight these values stand for (for tests and references)."""
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16)
        dense = self.matmul(eye).float().t()  # (out, in): column i is input i
        return dense.contiguous()

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) in x's dtype, from bfloat16 activations."""
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        rows = rows.contiguous() if self.input_perm is None else rows.index_select(1, self.input_perm)
        out: Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


def _bf16_at_least(values: Tensor) -> Tensor:
    """`values` as bfloat16, each rounded up (never below the float32 value), and above zero."""
    values = values.clamp(min=torch.finfo(torch.float32).tiny)
    stored = values.to(torch.bfloat16)
    low = stored.float() < values
    return torch.where(low, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)


QuantizedWeight = Int8Weight | W8A8Weight | Int4Weight | TritonInt8Weight | TritonInt4Weight
Linear = Callable[[Tensor, Tensor, Tensor | None], Tensor]


class Projection(Protocol):
    """A weight that does its own product: a quantized one, or a float one packed for a kernel
    (engine/layers/packed.py)."""

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes."""

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias)."""


def quantization_aware(linear: Linear) -> Callable[[Tensor, Tensor | Projection, Tensor | None], Tensor]:
    """`linear`, except that a quantized (or packed) weight does its own product."""

    def project(x: Tensor, weight: Tensor | Projection, bias: Tensor | None = None) -> Tensor:
        if isinstance(weight, Tensor):
            return linear(x, weight, bias)
        return weight.matmul(x, bias)

    return project


# modules of the Llama family (engine/models/llama.py) and their projection weights
PROJECTIONS = {"Attention": ("qkv_proj", "o_proj"), "MLP": ("gate_up_proj", "down_proj")}


def replace_projections(model: nn.Module, form: Callable[[str, Tensor], Projection]) -> int:
    """Every projection weight `name` of `prefix` becomes form(f"{prefix}.{name}", weight), in place;
    returns the bytes they now take."""
    total = 0
    for prefix, module in model.named_modules():
        names = PROJECTIONS.get(type(module).__name__, ())
        for name in names:
            quantized = form(f"{prefix}.{name}", getattr(module, name))
            delattr(module, name)  # a parameter: the plain attribute replaces it
            setattr(module, name, quantized)
            total += quantized.nbytes
        if names:
            setattr(module, "linear", quantization_aware(getattr(module, "linear")))  # noqa: B009, B010
    return total


def quantize_model(
    model: nn.Module,
    method: str,
    triton: bool = False,
    int4: Callable[[Tensor], Projection] | None = None,
) -> int:
    """Replace the model's projection weights and LM head by `method`'s form, in place (the Triton
    kernels' layouts when `triton`; `int4`, where given, makes int4's projections: the C product's
    PackedInt4Weight); returns the bytes the projections and the head now take."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, got {method!r}")
    int8: Callable[[Tensor], QuantizedWeight] = TritonInt8Weight.quantize if triton else Int8Weight.quantize
    if int4 is None:
        int4 = TritonInt4Weight.quantize if triton else Int4Weight.quantize
    forms: dict[str, Callable[[Tensor], Projection]] = {
        "int8": int8,
        "int4": int4,
        "w8a8": W8A8Weight.quantize,
    }

    def form(name: str, weight: Tensor) -> Projection:
        # w8a8: int8 activations for the norm-fed projections (QKV, gate/up; smoothed first by
        # engine/layers/smoothing.py); o_proj and down_proj stay weight-only int8
        weight_only = method == "w8a8" and name.endswith(("o_proj", "down_proj"))
        return int8(weight) if weight_only else forms[method](weight)

    return replace_projections(model, form) + quantize_head(model, triton)


def quantize_head(model: nn.Module, triton: bool = False) -> int:
    """The LM head as per-channel int8, in place (for int4 too: the logits of a whole vocabulary feel
    4-bit steps most); returns its bytes."""
    int8: Callable[[Tensor], QuantizedWeight] = TritonInt8Weight.quantize if triton else Int8Weight.quantize
    llama: Any = model  # engine/models/llama.py's LlamaForCausalLM
    head = int8(llama.embed_tokens if llama.lm_head is None else llama.lm_head)
    if llama.lm_head is not None:  # untied: the head's float weight is no longer read
        del llama.lm_head
        llama.lm_head = None
    llama.head_weight = head
    return head.nbytes
