"""SmoothQuant-style smoothing for `quantization="w8a8"`: move activation outliers into the weights.

Int8 activations with one scale per row spend their 8 bits on the few channels of the residual
stream that run far larger than the rest. They reach the QKV and gate/up projections through the
RMSNorms, and those two are the ones w8a8 runs with int8 activations (o_proj and down_proj stay
weight-only: their inputs cost the most accuracy for the least time; docs/quantization.md).
Dividing input channel j by s_j and multiplying the weight's column j by s_j leaves the product
unchanged; s_j = max|x_j|^0.5 / max|W_:,j|^0.5 evens out the two operands' ranges (Xiao et al.,
SmoothQuant, alpha 0.5, the best of 0.4 / 0.5 / 0.65 / 0.75 on the default model). The division
folds into the norm's weight, so serving costs nothing. The channel maxima come from one prefill
of fixed pseudo-random tokens: the outlier channels belong to the model, not to the text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ALPHA = 0.5
CALIBRATION_TOKENS = 512
_FLOOR = 1e-5

# per smoothed projection: (its module, its weight, the norm that feeds it and takes the division)
_SMOOTHED = (
    ("self_attn", "qkv_proj", "input_layernorm"),
    ("mlp", "gate_up_proj", "post_attention_layernorm"),
)


def input_maxima(model: nn.Module, run_prefill: Callable[[list[int]], None]) -> dict[int, torch.Tensor]:
    """Per smoothed projection weight (by id), the largest |input| of each channel over a prefill."""
    maxima: dict[int, torch.Tensor] = {}
    watched: set[int] = set()
    saved: list[tuple[Any, Any]] = []
    llama: Any = model
    for layer in llama.layers:
        for owner_name, weight_name, _ in _SMOOTHED:
            owner = getattr(layer, owner_name)
            watched.add(id(getattr(owner, weight_name)))
            linear = owner.linear

            def record(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, linear: Any = linear) -> Any:
                key = id(w)
                if key in watched:
                    seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
                    maxima[key] = seen if key not in maxima else torch.maximum(maxima[key], seen)
                return linear(x, w, b)

            saved.append((owner, linear))
            owner.linear = record
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = llama.embed_tokens.shape[0]
        run_prefill(torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=gen).tolist())
    finally:
        for owner, linear in reversed(saved):
            owner.linear = linear
    return maxima


def smooth(model: nn.Module, maxima: dict[int, torch.Tensor]) -> int:
    """Fold s into each smoothed projection and its norm, in place; returns how many were smoothed."""
    llama: Any = model
    done = 0
    with torch.no_grad():
        for layer in llama.layers:
            for owner_name, weight_name, norm_name in _SMOOTHED:
                weight = getattr(getattr(layer, owner_name), weight_name)
                act = maxima.get(id(weight))
                if act is None:
                    continue
                w_max = weight.detach().abs().amax(dim=0).float().clamp(min=_FLOOR)
                s = (act.clamp(min=_FLOOR) ** ALPHA / w_max ** (1 - ALPHA)).clamp(min=_FLOOR)
                norm = getattr(layer, norm_name)
                norm.weight.div_(s.to(norm.weight.dtype))
                weight.mul_(s.to(weight.dtype)[None, :])
                done += 1
    return done
