"""Launchers of the fused float32 CPU decode operations (cpu_decode.c; built by kernels/cpu_native.py).

Around a decode row's four projections a layer runs ~40 small torch operations (norms, the QKV
split, rotary, the KV store, the paged attention's gathers and softmax), each a few microseconds
of dispatch: at batch 1 they cost more than the products. These calls do the same work in one
pass each. The references are in kernels/reference.py (tests/kernels/test_cpu_decode.py compares):
`rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, and `rotary_embedding` + `store_kv` +
`paged_decode_attention` for `attention` (their sums run in another order: close, not equal). The
engine sends every float32 row of every step to them, prefill rows included (`attention` takes
any rows, each with its own table and context length, consecutive rows of one sequence sharing
each key they read): each row is computed on its own in one fixed order, so a row's bits do not
depend on the rows beside it, which is what batch-invariant mode needs.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

MAX_HEAD_DIM = 256  # the C code keeps a KV head's queries and outputs on the stack
MAX_GROUP = 16  # query heads per KV head, at most


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `attention` takes a model of this shape (head_dim in 16s up to 256, GQA groups <= 16)."""
    return (
        heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
    )


_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


def _contiguous_f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")


def check_step(
    rows: int,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """A step's per-row tensors as the attention block reads them: positions and slots (rows,)
    int64, block_tables (rows, width) and context_lens (rows,) int32, contiguous, on the CPU."""
    for name, t, dtype, dims in (
        ("positions", positions, torch.int64, 1),
        ("slots", slots, torch.int64, 1),
        ("block_tables", block_tables, torch.int32, 2),
        ("context_lens", context_lens, torch.int32, 1),
    ):
        if t.dtype != dtype or t.dim() != dims or t.shape[0] != rows or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(
                f"{name} must be ({rows}, ...) contiguous {dtype}, got {t.dtype} {tuple(t.shape)}"
            )


class CpuDecode:
    """The fused calls of one loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.add_rms_norm_f32
        self._norm.argtypes = [_P, _P, _P, _F, _L, _L, _P, _P]
        self._norm.restype = None
        self._silu = library.silu_and_mul_f32
        self._silu.argtypes = [_P, _L, _L, _P]
        self._silu.restype = None
        self._attention = library.decode_attention_f32
        # qkv, rows, heads, kv_heads, head_dim, positions, max_positions, cos, sin, k_cache, v_cache,
        # block_size, slots, block_tables, table_width, context_lens, max_context, scale, out
        self._attention.argtypes = [_P, _L, _L, _L, _L, _P, _L, _P, _P, _P, _P]
        self._attention.argtypes += [_L, _P, _P, _L, _P, _L, _F, _P]
        self._attention.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight over the last dimension; x (rows, dim)."""
        return self._add_norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual); new tensors, the inputs untouched."""
        out, summed = self._add_norm(x, residual, weight, eps)
        assert summed is not None
        return out, summed

    def _add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _contiguous_f32("x", x)
        _contiguous_f32("weight", weight)
        if x.dim() != 2 or weight.shape != (x.shape[1],):
            raise ValueError(
                f"x must be (rows, dim) and weight (dim,), got {tuple(x.shape)}, {tuple(weight.shape)}"
            )
        out = torch.empty_like(x)
        summed = None
        if residual is not None:
            _contiguous_f32("residual", residual)
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
            summed = torch.empty_like(x)
        self._norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            eps,
            x.shape[0],
            x.shape[1],
            out.data_ptr(),
            None if summed is None else summed.data_ptr(),
        )
        return out, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, 2d) -> silu(x[:, :d]) * x[:, d:]."""
        _contiguous_f32("x", x)
        if x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(f"x must be (rows, 2 * d), got {tuple(x.shape)}")
        d = x.shape[1] // 2
        out = x.new_empty((x.shape[0], d))
        self._silu(x.data_ptr(), x.shape[0], d, out.data_ptr())
        return out

    def attention(
        self,
        qkv: torch.Tensor,
        shape: tuple[int, int, int],
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """The attention block of any rows: (rows, (heads + 2 kv_heads) * head_dim) QKV projection ->
        (rows, heads * head_dim) attention output, the rows' rotated K and V stored in the cache.

        shape: (heads, kv_heads, head_dim); positions, slots: (rows,) int64 (slot < 0 or a position
        past the tables: padding, output zeros); cos_sin: (max_positions, head_dim) tables; caches
        (num_blocks, block_size, kv_heads, head_dim) float32; block_tables (rows, width) int32, each
        row's own (a prefill's rows: their sequence's); context_lens (rows,) int32 with the row's own
        token (read up to width * block_size at most)."""
        bound = self.bind_attention(shape, cos_sin, k_cache, v_cache, scale)
        return bound(qkv, positions, slots, block_tables, context_lens)

    def bind_attention(
        self,
        shape: tuple[int, int, int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> BoundAttention:
        """`attention` for one layer's caches and rotary tables, checked now: its calls check only
        the step's tensors (a decode step makes one call a layer; the checks of the constant ones
        cost as much as the attention of a short context)."""
        heads, kv_heads, head_dim = shape
        cos, sin = cos_sin
        for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
            _contiguous_f32(name, t)
        if not supports(heads, kv_heads, head_dim):
            raise ValueError(
                f"{heads} heads over {kv_heads} KV heads of {head_dim}: head_dim must be a multiple of 16 "
                f"up to {MAX_HEAD_DIM}, at most {MAX_GROUP} heads per KV head"
            )
        if cos.shape[1] != head_dim or sin.shape != cos.shape:
            raise ValueError(f"rotary tables {tuple(cos.shape)} for head_dim {head_dim}")
        if k_cache.dim() != 4 or k_cache.shape[2:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
            raise ValueError(f"caches {tuple(k_cache.shape)} do not hold {kv_heads} heads of {head_dim}")
        return BoundAttention(self._attention, shape, cos_sin, (k_cache, v_cache), scale)


class BoundAttention:
    """CpuDecode.attention for one layer's caches and rotary tables (CpuDecode.bind_attention)."""

    __slots__ = ("_constants", "_kernel", "_out_width", "_tensors", "_width")

    def __init__(
        self,
        kernel: Any,
        shape: tuple[int, int, int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> None:
        heads, kv_heads, head_dim = shape
        cos, sin = cos_sin
        self._kernel = kernel
        self._tensors = (*cos_sin, *caches)  # kept alive: the kernel reads them by address
        k_cache, v_cache = caches
        self._constants: tuple[Any, ...] = (
            heads, kv_heads, head_dim, cos.shape[0], cos.data_ptr(), sin.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], float(scale),
        )  # fmt: skip
        self._width = (heads + 2 * kv_heads) * head_dim
        self._out_width = heads * head_dim

    def __call__(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """(rows, (heads + 2 kv_heads) * head_dim) -> (rows, heads * head_dim): CpuDecode.attention."""
        rows = qkv.shape[0]
        if (
            qkv.dtype != torch.float32
            or not qkv.is_contiguous()
            or not qkv.is_cpu
            or qkv.shape[1:] != (self._width,)
        ):
            raise ValueError(
                f"qkv must be contiguous float32 on the CPU and hold {self._width} values a row "
                f"(heads + 2 x KV heads): it does not hold them, got {qkv.dtype} {tuple(qkv.shape)}"
            )
        check_step(rows, positions, slots, block_tables, context_lens)
        heads, kv_heads, head_dim, max_positions, cos, sin, k_cache, v_cache, block_size, scale = (
            self._constants
        )
        width = block_tables.shape[1]
        out = qkv.new_empty((rows, self._out_width))
        failed = self._kernel(
            qkv.data_ptr(), rows, heads, kv_heads, head_dim, positions.data_ptr(), max_positions, cos, sin,
            k_cache, v_cache, block_size, slots.data_ptr(), block_tables.data_ptr(), width,
            context_lens.data_ptr(), width * block_size, scale, out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for the attention scores of a {width * block_size}-token context")
        return out
