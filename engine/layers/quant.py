"""Weight-only int8 quantization at load time (`quantization="int8"`): the CPU path.

Each projection (QKV, output, gate/up, down) and the LM head becomes int8 with one scale per output
channel (symmetric: w ≈ q * s, s = max|w_row| / 127). Decode reads the weights once per step, so
a quarter of the bytes is most of the speed: torch's packed-int8 matmul
(`aten._weight_int8pack_mm`, bfloat16 activations, float32 accumulation) runs a batch-1 step of
the default model in ~33 ms against 44–80 ms in float32 (docs/BENCHMARKS.md). It also computes
each row on its own, so its results do not depend on the batch: batch invariance holds as it does
in float32. Its float32-activation variant is 10x slower here, hence the bfloat16 activations
(which move perplexity by 0.01%; the int8 weights by ~1%: docs/quantization.md).

The embedding table stays in the model's dtype for the lookups (tied to the LM head, the head gets
its own int8 copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.config import QUANTIZATIONS

Tensor = torch.Tensor
_QMAX = 127


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
        scale = (w.abs().amax(dim=1) / _QMAX).clamp(min=torch.finfo(torch.float32).tiny)
        stored = scale.to(torch.bfloat16)
        low = stored.float() < scale  # rounded down: take the next bfloat16 up
        stored = torch.where(low, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
        q = torch.round(w / stored.float()[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
        return cls(q.contiguous(), stored)

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


Linear = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def int8_aware(linear: Linear) -> Callable[[Tensor, Tensor | Int8Weight, Tensor | None], Tensor]:
    """`linear`, except that an Int8Weight does its own product."""

    def project(x: Tensor, weight: Tensor | Int8Weight, bias: Tensor | None = None) -> Tensor:
        if isinstance(weight, Int8Weight):
            return weight.matmul(x, bias)
        return linear(x, weight, bias)

    return project


# modules of the Llama family (engine/models/llama.py) and their projection weights
_PROJECTIONS = {"Attention": ("qkv_proj", "o_proj"), "MLP": ("gate_up_proj", "down_proj")}


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the model's projection weights and LM head by `method`'s form, in place; returns the
    bytes the projections and the head now take."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, got {method!r}")
    total = 0
    for module in model.modules():
        names = _PROJECTIONS.get(type(module).__name__, ())
        for name in names:
            quantized = Int8Weight.quantize(getattr(module, name))
            delattr(module, name)  # a parameter: the plain attribute replaces it
            setattr(module, name, quantized)
            total += quantized.nbytes
        if names:
            setattr(module, "linear", int8_aware(getattr(module, "linear")))  # noqa: B009, B010
    llama: Any = model  # engine/models/llama.py's LlamaForCausalLM
    head = Int8Weight.quantize(llama.embed_tokens if llama.lm_head is None else llama.lm_head)
    if llama.lm_head is not None:  # untied: the head's float weight is no longer read
        del llama.lm_head
        llama.lm_head = None
    llama.quantized_head = head
    return total + head.nbytes
