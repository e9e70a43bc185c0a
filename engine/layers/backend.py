"""Which kernels a model runs: the torch references (CPU) or the Triton kernels (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.checks import interpreting
from kernels.cpu_decode import CpuDecode
from kernels.cpu_native import CpuKernels

Tensor = torch.Tensor


@dataclass(frozen=True)
class KernelBackend:
    """The kernel set one model instance calls; chosen once, when the model is built."""

    name: str  # "torch" or "triton"
    # (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale): scales for int8/fp8 pools
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None], None]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotary_embedding: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    # y = x @ w.T (+ b): the model's projections and LM head
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = F.linear
    # the LM head in fixed vocabulary slices, which keeps it batch-invariant on CPU (torch only)
    chunked_logits: bool = True
    # C kernels for the attention block (CPU, float32) and `every_row`: every row of every step goes
    # to them (a row's result computed alike whatever the rows beside it; the runner gives each row
    # its block table). engine/models/llama.py's Attention applies them
    cpu_decode: CpuDecode | None = None
    every_row: bool = False

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


# Up to this many rows, `small_batch_linear` computes (w @ x.T).T; past it, F.linear.
SMALL_BATCH_ROWS = 64


def small_batch_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x @ w.T (+ b), with MKL's fast path for a few rows (decode steps).

    On CPU, MKL's sgemm for x (m, k) @ w.T with m of 1 to 8 rows reads the weights at a third of the
    memory bandwidth that w (n, k) @ x.T (m columns) reaches: a batch-1 decode step of the default
    model spends 44 ms instead of 74 ms (docs/BENCHMARKS.md). The result is the transposed view of
    that product (the next projection reads it as a contiguous operand). Its rounding depends on the
    number of rows, so it is used only when batch invariance is off.
    """
    if x.dim() != 2 or x.shape[0] > SMALL_BATCH_ROWS:
        return F.linear(x, w, b)
    out = torch.mm(w, x.t()).t()
    return out if b is None else out + b


def _f32_rows(x: Tensor) -> bool:
    return x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()


def cpu_kernel_backend(kernels: CpuKernels, batch_invariant: bool = True) -> KernelBackend:
    """The torch backend with the C kernels for every float32 row: norms, SiLU-and-mul and the
    attention block compute each row on its own in one fixed order (kernels/cpu_decode.c), so a
    row's bits do not depend on the batch, the chunking or the threads, whether it is a decode row
    or a prefill's (batch-invariant by construction). Which kernel a call takes depends only on the
    model (dtype, shapes), never on the step's row count. Without batch invariance the projections
    left to MKL (weights the C product does not take) use `small_batch_linear` and the LM head one
    product."""
    decode = kernels.decode

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if _f32_rows(x) and weight.dtype == torch.float32:
            return decode.rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)

    def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        if _f32_rows(x) and _f32_rows(residual) and weight.dtype == torch.float32:
            return decode.add_rms_norm(x, residual, weight, eps)
        return reference.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(x: Tensor) -> Tensor:
        return decode.silu_and_mul(x) if _f32_rows(x) else reference.silu_and_mul(x)

    backend = replace(
        TORCH_BACKEND,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        silu_and_mul=silu_and_mul,
        cpu_decode=decode,
        every_row=True,
    )
    return backend if batch_invariant else replace(backend, linear=small_batch_linear, chunked_logits=False)


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


def load_backend(name: str, batch_invariant: bool = True, cpu: CpuKernels | None = None) -> KernelBackend:
    """The kernel set called `name` ("torch" or "triton"); Triton is imported only when asked for.

    torch without batch invariance computes small batches' projections the fast way
    (`small_batch_linear`) and the LM head in one product; given the C kernels (`cpu`), every
    float32 row goes to them in both modes (`cpu_kernel_backend`).
    """
    if name == "torch":
        if cpu is not None:
            return cpu_kernel_backend(cpu, batch_invariant)
        if batch_invariant:
            return TORCH_BACKEND
        return replace(TORCH_BACKEND, linear=small_batch_linear, chunked_logits=False)
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
        chunked_logits=False,
    )
