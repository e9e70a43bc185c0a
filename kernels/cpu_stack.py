"""Launcher of a Llama-family decoder stack in one C call (cpu_stack.c; built by kernels/cpu_native.py).

A float32 CPU model whose products are all the C kernel's (kernels/cpu_gemm.py's PanelProduct over
packed float32, int8, w8a8 or int4 weights) and whose attention block is cpu_decode.c's runs a
step's layers through ~240 calls from Python at the default model's 30 layers; at batch 1 their
dispatch costs about as much as the kernels. `CpuStack.bind` checks a model's weights, norms,
caches and rotary tables once; the bound stack's call then runs every layer and the final norm in
C, with the same kernels in the same order on the same inputs as the layer-by-layer path, so it
gives the same bits (tests/kernels/test_cpu_stack.py) and keeps each row on its own (batch
invariance by construction, as those kernels do).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_decode import check_step, supports
from kernels.cpu_gemm import PanelProduct

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class _Projection(ctypes.Structure):
    _fields_ = [
        ("kind", _L),
        ("packed", _P),
        ("scales", _P),
        ("group", _L),
        ("k", _L),
        ("n", _L),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _L),
        ("hidden", _L),
        ("heads", _L),
        ("kv_heads", _L),
        ("head_dim", _L),
        ("intermediate", _L),
        ("eps", _F),
        ("scale", _F),
        ("final_norm", _P),
        ("max_positions", _L),
        ("cos", _P),
        ("sin", _P),
        ("block_size", _L),
    ]


@dataclass(frozen=True)
class StackShape:
    """The model's sizes the stack is bound for."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # every norm's
    scale: float  # the attention's softmax scale


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's weights (norms (hidden,), products as bound) and paged KV caches."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PanelProduct
    qkv_bias: torch.Tensor | None
    o: PanelProduct
    gate_up: PanelProduct
    down: PanelProduct
    k_cache: torch.Tensor  # (num_blocks, block_size, kv_heads, head_dim) float32
    v_cache: torch.Tensor
    o_bias: torch.Tensor | None = None  # the other projections' biases (Llama's attention_bias, mlp_bias)
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def _contiguous_f32(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")


class CpuStack:
    """The stack call of one loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.decode_stack_f32
        # model, layers, rows, h, positions, slots, block_tables, table_width, context_lens,
        # max_context, out
        self._run.argtypes = [_P, _P, _L, _P, _P, _P, _P, _L, _P, _L, _P]
        self._run.restype = ctypes.c_int

    def bind(
        self,
        shape: StackShape,
        layers: Sequence[StackLayer],
        final_norm: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> BoundStack:
        """The stack of `layers` (at least one), checked now: its calls check only the step's tensors."""
        s = shape
        if not layers:
            raise ValueError("the stack needs at least one layer")
        if not supports(s.heads, s.kv_heads, s.head_dim):
            raise ValueError(
                f"{s.heads} heads over {s.kv_heads} KV heads of {s.head_dim}: not the C attention's shape"
            )
        cos, sin = cos_sin
        _contiguous_f32("cos", cos)
        _contiguous_f32("sin", sin, tuple(cos.shape))
        if cos.dim() != 2 or cos.shape[1] != s.head_dim:
            raise ValueError(f"rotary tables {tuple(cos.shape)} for head_dim {s.head_dim}")
        _contiguous_f32("final_norm", final_norm, (s.hidden,))
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        block_size = layers[0].k_cache.shape[1] if layers[0].k_cache.dim() == 4 else 0
        structs = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            for name, norm in (("input_norm", layer.input_norm), ("post_norm", layer.post_norm)):
                _contiguous_f32(f"layer {i}'s {name}", norm, (s.hidden,))
            for name, cache in (("k_cache", layer.k_cache), ("v_cache", layer.v_cache)):
                _contiguous_f32(f"layer {i}'s {name}", cache)
                if cache.dim() != 4 or tuple(cache.shape[1:]) != (block_size, s.kv_heads, s.head_dim):
                    raise ValueError(
                        f"layer {i}'s {name} {tuple(cache.shape)} does not hold blocks of {block_size} "
                        f"tokens x {s.kv_heads} heads of {s.head_dim}"
                    )
            products = (
                ("qkv", layer.qkv, layer.qkv_bias, s.hidden, q_size + 2 * kv_size),
                ("o", layer.o, layer.o_bias, q_size, s.hidden),
                ("gate_up", layer.gate_up, layer.gate_up_bias, s.hidden, 2 * s.intermediate),
                ("down", layer.down, layer.down_bias, s.intermediate, s.hidden),
            )
            for name, product, bias, k, n in products:
                if (product.k, product.n) != (k, n):
                    raise ValueError(
                        f"layer {i}'s {name} multiplies {product.k} inputs into {product.n} outputs, "
                        f"expected {k} into {n}"
                    )
                if bias is not None:
                    _contiguous_f32(f"layer {i}'s {name}_bias", bias, (n,))
            structs[i] = _Layer(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                *(_projection(product, bias) for _, product, bias, _, _ in products),
                layer.k_cache.data_ptr(),
                layer.v_cache.data_ptr(),
            )
        model = _Model(
            len(layers), s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps, s.scale,
            final_norm.data_ptr(), cos.shape[0], cos.data_ptr(), sin.data_ptr(), block_size,
        )  # fmt: skip
        return BoundStack(self._run, model, structs, (tuple(layers), final_norm, cos, sin), s.hidden)


def _projection(product: PanelProduct, bias: torch.Tensor | None) -> _Projection:
    weight = product.weight
    scales = weight[1].data_ptr() if len(weight) > 1 else None
    bias_ptr = None if bias is None else bias.data_ptr()
    return _Projection(
        product.kind, weight[0].data_ptr(), scales, product.group, product.k, product.n, bias_ptr
    )


class BoundStack:
    """A model's decoder stack bound by CpuStack.bind: `stack(h, positions, slots, tables, lens)`."""

    __slots__ = ("_block_size", "_kernel", "_model", "_structs", "_tensors", "hidden")

    def __init__(
        self, kernel: object, model: _Model, layers: ctypes.Array[_Layer], tensors: object, hidden: int
    ) -> None:
        self._kernel = kernel
        self._structs = (model, layers)  # kept alive: passed by address
        self._model = ctypes.addressof(model)
        self._tensors = tensors  # kept alive: the kernel reads them by address
        self._block_size = model.block_size
        self.hidden = hidden

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """h (rows, hidden) embeddings -> (rows, hidden) the final norm's output. `h` is consumed (the
        kernel's scratch); the rows' K and V are stored in every layer's cache. positions, slots:
        (rows,) int64; block_tables (rows, width) int32, each row's own; context_lens (rows,) int32
        with the row's own token (cpu_decode.py's `attention`)."""
        rows = h.shape[0]
        if h.dtype != torch.float32 or not h.is_contiguous() or not h.is_cpu or h.shape[1:] != (self.hidden,):
            raise ValueError(
                f"h must be (rows, {self.hidden}) contiguous float32, got {h.dtype} {tuple(h.shape)}"
            )
        check_step(rows, positions, slots, block_tables, context_lens)
        out = torch.empty_like(h)
        if rows == 0:
            return out
        width = block_tables.shape[1]
        failed = self._kernel(  # type: ignore[operator]
            self._model, ctypes.addressof(self._structs[1]), rows, h.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), block_tables.data_ptr(), width, context_lens.data_ptr(),
            width * self._block_size, out.data_ptr(),
        )  # fmt: skip
        if failed == -1:
            raise MemoryError(f"no memory for the scratch of a {rows}-row step")
        if failed:
            raise RuntimeError("a product of the stack does not run on this CPU or for these shapes")
        return out
