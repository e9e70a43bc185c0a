"""A Llama-family model's decoder stack as one C call per step on the CPU (kernels/cpu_stack.py).

Where every projection of a float32 CPU model is a C product over packed weights and the attention
block is the C one, a step's ~240 calls from Python to the kernels (8 a layer) become one: the same
kernels in the same order, so the same bits. A batch-1 decode step of the default model at int4
spends about as long in Python's dispatch between the kernels as in them (docs/BENCHMARKS.md).
`fuse_stack` binds the model's weights and caches once, after the caches are allocated; the model's
forward then hands a step to the stack whenever the step fits it (`FusedStack.__call__` says None
otherwise, and the layer-by-layer path runs).
"""

from __future__ import annotations

import logging

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.kv_cache import LayerKVCache
from engine.layers.packed import stack_product
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.cpu_stack import BoundStack, CpuStack, StackLayer, StackShape

logger = logging.getLogger(__name__)


class FusedStack:
    """The bound stack of one model and its caches, with the steps it takes."""

    def __init__(self, bound: BoundStack, kv_caches: list[LayerKVCache], max_rows: int | None) -> None:
        self.bound = bound
        self.kv_caches = kv_caches  # the runner's list: a step over any other caches is not ours
        self.max_rows = max_rows  # None: any number of rows

    def __call__(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final hidden states of the step's rows (`h`: their embeddings, consumed), or None when
        the step is not the stack's: other caches, padding rows, no per-row tables, too many rows."""
        rows = h.shape[0]
        if (
            kv_caches is not self.kv_caches
            or meta.row_block_tables is None
            or meta.row_context_lens is None
            or meta.num_actual_tokens != rows
            or (self.max_rows is not None and rows > self.max_rows)
            or h.dtype != torch.float32
        ):
            return None
        return self.bound(
            h.contiguous(), positions, meta.slot_mapping, meta.row_block_tables, meta.row_context_lens
        )


def fuse_stack(
    model: LlamaForCausalLM, launcher: CpuStack, kv_caches: list[LayerKVCache]
) -> FusedStack | None:
    """The model's stack bound for `launcher`, or None where a layer does not fit it: a projection
    that is not a C product (MKL's, or int4 with act-order's input permutation), query/key norms,
    tensor parallelism, quantized or non-float32 caches, a head shape the C attention does not take."""
    cfg = model.cfg
    decoders = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    if (
        model.tp is not None
        or cfg.qk_norm
        or not decoders
        or not len(decoders) == len(model.layers) == len(kv_caches)
    ):
        return None
    layers: list[StackLayer] = []
    max_rows: int | None = None
    for layer, cache in zip(decoders, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.cpu_decode is None or cache.k_scale is not None or cache.k.dtype != torch.float32:
            return None
        products = []
        for weight in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            fitted = stack_product(weight)
            if fitted is None:
                return None
            product, limit = fitted
            products.append(product)
            if limit is not None:
                max_rows = limit if max_rows is None else min(max_rows, limit)
        layers.append(
            StackLayer(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                products[0],
                _data(attn.qkv_bias),
                products[1],
                products[2],
                products[3],
                cache.k,
                cache.v,
                o_bias=_data(attn.o_bias),
                gate_up_bias=_data(mlp.gate_up_bias),
                down_bias=_data(mlp.down_bias),
            )
        )
    first = decoders[0].self_attn
    shape = StackShape(
        cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim, cfg.intermediate_size,
        cfg.rms_norm_eps, first.attn.scale,
    )  # fmt: skip
    rotary = model.rotary
    try:
        bound = launcher.bind(shape, layers, model.norm.weight.data, (rotary.cos_cache, rotary.sin_cache))
    except ValueError as exc:  # a tensor the stack does not take (dtype, layout)
        logger.info("the decoder stack runs layer by layer: %s", exc)
        return None
    return FusedStack(bound, kv_caches, max_rows)


def _data(bias: torch.nn.Parameter | None) -> torch.Tensor | None:
    return None if bias is None else bias.data
