"""Which kernels a model runs: the torch references (CPU) or the Triton kernels (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference
from kernels.checks import interpreting

Tensor = torch.Tensor


@dataclass(frozen=True)
class KernelBackend:
    """The kernel set one model instance calls; chosen once, when the model is built."""

    name: str  # "torch" or "triton"
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotary_embedding: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]

    @property
    def is_triton(self) -> bool:
        """True for the Triton kernels."""
        return self.name == "triton"


TORCH_BACKEND = KernelBackend(
    name="torch",
    store_kv=reference.store_kv,
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    rotary_embedding=reference.rotary_embedding,
    silu_and_mul=reference.silu_and_mul,
)


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """`auto`: Triton on CUDA, torch on CPU. Triton on CPU runs only under the interpreter."""
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            "attention_backend='triton' on CPU runs through Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before starting (it is slow; meant for tests), or use 'torch'"
        )
    return requested


def load_backend(name: str) -> KernelBackend:
    """The kernel set called `name` ("torch" or "triton"); Triton is imported only when asked for."""
    if name == "torch":
        return TORCH_BACKEND
    if name != "triton":
        raise ValueError(f"unknown kernel backend {name!r}")
    from kernels.activation import silu_and_mul
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding
    from kernels.store_kv import store_kv

    return KernelBackend(
        name="triton",
        store_kv=store_kv,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
    )
