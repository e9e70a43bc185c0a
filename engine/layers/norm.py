"""RMSNorm, computed in float32 exactly as HF transformers does (or by the Triton kernel)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.backend import TORCH_BACKEND, KernelBackend


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension."""

    def __init__(self, dim: int, eps: float, backend: KernelBackend = TORCH_BACKEND) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the Triton kernel updates `residual` in place."""
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)
