"""Loading a checkpoint into the model, with each projection in the form it is served in.

A float checkpoint loads as it is, then `quantization` int8/int4 quantizes it. A pre-quantized one
(AWQ, GPTQ, FP8; engine/prequantized.py, found from config.json) is unpacked and served by the
quantized kernels: on the CPU the torch packed-int kernels (4-bit grids as int4 with their own
values; 8-bit grids and FP8 as per-channel int8), with the Triton backend (the GPU) the Triton
int4/int8 matmuls of kernels/quant_matmul.py in the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from engine.config import QUANTIZATIONS, EngineConfig
from engine.gguf_blocks import GROUP, Q4Blocks, read_blocks
from engine.layers.packed import PackedInt4Weight
from engine.layers.quant import (
    PROJECTIONS,
    Int4Weight,
    Int8Weight,
    Projection,
    quantize_head,
    quantize_model,
    replace_projections,
)
from engine.layers.quant_triton import TritonInt4Weight, TritonInt8Weight
from engine.layers.smoothing import input_maxima, smooth
from engine.prequantized import CheckpointQuant, Grid, iter_prequantized, read_checkpoint_quant
from engine.weights import iter_weights
from kernels.cpu_gemm import CpuGemm

logger = logging.getLogger(__name__)
_Part = TypeVar("_Part")


def check_quantization(asked: str | None, spec: CheckpointQuant | None, model_dir: Path) -> None:
    """ValueError unless `quantization=asked` can apply to the checkpoint in `model_dir`, quantized
    as `spec` says (None: a float checkpoint)."""
    if spec is None:
        if asked is not None and asked not in QUANTIZATIONS:
            raise ValueError(f"quantization={asked!r} needs a checkpoint quantized so; {model_dir} is not")
    elif asked is not None and asked not in (spec.method, spec.source):
        raise ValueError(
            f"the checkpoint is already quantized ({spec.source}); quantization={asked!r} cannot apply: "
            "leave it unset"
        )


def load_weights(
    model: nn.Module,
    model_dir: Path,
    config: EngineConfig,
    triton: bool,
    prefill: Callable[[list[int]], None] | None = None,
    gemm: CpuGemm | None = None,
) -> str | None:
    """Load the checkpoint into `model` and put its projections in their served form; returns the
    quantization served (the checkpoint's method, int8/int4/w8a8 at load, or None). `prefill` runs
    the float model over tokens: w8a8 calibrates its smoothing with it (engine/layers/smoothing.py).
    With `gemm` (the CPU's C products), 4-bit projections are packed for its int4 product."""
    llama: Any = model
    dtype = next(model.parameters()).dtype
    asked = config.quantization
    if asked == "w8a8" and triton:
        raise ValueError("quantization='w8a8' runs on the CPU path (torch's integer matmul): use 'int8' here")
    spec = read_checkpoint_quant(model_dir)
    check_quantization(asked, spec, model_dir)
    if spec is None:
        blocks = read_blocks(model_dir) if asked == "int4" and gemm is not None and not triton else None
        if blocks is not None and gemm is not None and serve_blocks(model, blocks, gemm):
            llama.load_weights(iter_weights(model_dir, dtype, skip=blocks))
            nbytes = quantize_head(model) + sum(p.nbytes for p in projection_weights(model))
            logger.info(
                "weights: int4 (the GGUF's Q4_1 blocks), %.1f MiB of projections and LM head", nbytes / 2**20
            )
            return asked
        llama.load_weights(iter_weights(model_dir, dtype))
        if asked == "w8a8" and prefill is not None:
            smoothed = smooth(model, input_maxima(model, prefill))
            logger.info("w8a8: %d norm-fed projections smoothed", smoothed)
        if asked is not None:
            int4 = None if gemm is None else lambda weight: PackedInt4Weight.quantize(weight, gemm)
            nbytes = quantize_model(model, asked, triton, int4)
            logger.info("weights: %s, %.1f MiB of projections and LM head", asked, nbytes / 2**20)
        return asked
    grids: dict[str, Grid] = {}
    llama.load_weights(iter_prequantized(model_dir, spec, dtype, grids))
    form, nbytes = serve_prequantized(model, grids, triton, gemm)
    logger.info("weights: %s checkpoint as %s, %.1f MiB of projections", spec.source, form, nbytes / 2**20)
    return spec.source


def serve_prequantized(
    model: nn.Module, grids: dict[str, Grid], triton: bool = False, gemm: CpuGemm | None = None
) -> tuple[str, int]:
    """A pre-quantized checkpoint's projections in the kernels' forms, in place: 4-bit grids as
    int4 with their own values (for `gemm`'s int4 product where given); 8-bit grids and FP8 weights
    (loaded as floats) as per-channel int8. The LM head stays as the checkpoint has it. Returns (the
    forms used, bytes of the projections)."""
    llama: Any = model  # engine/models/llama.py's LlamaForCausalLM
    fused = fuse_shards(grids, llama.param_name_of, Grid.concat)
    kinds: set[str] = set()

    def form(name: str, weight: torch.Tensor) -> Projection:
        grid = fused.get(name)
        quantized: Projection
        if grid is not None and grid.bits == 4 and gemm is not None and not triton:
            quantized = PackedInt4Weight.from_grid(
                grid.q, grid.zeros, grid.scales, grid.g_idx, grid.group_size, gemm
            )
        elif grid is not None and grid.bits == 4 and triton:
            quantized = TritonInt4Weight.from_grid(
                grid.q, grid.zeros, grid.scales, grid.g_idx, grid.group_size, weight.device
            )
        elif grid is not None and grid.bits == 4:
            quantized = Int4Weight.from_grid(grid.q, grid.zeros, grid.scales, grid.g_idx, grid.group_size)
        else:  # GPTQ 8-bit and FP8, loaded dequantized: one scale per output channel
            quantized = TritonInt8Weight.quantize(weight) if triton else Int8Weight.quantize(weight)
        kinds.add(
            "int4" if isinstance(quantized, Int4Weight | TritonInt4Weight | PackedInt4Weight) else "int8"
        )
        return quantized

    total = replace_projections(model, form)
    return "+".join(sorted(kinds)), total


def serve_blocks(model: nn.Module, blocks: dict[str, Q4Blocks], gemm: CpuGemm) -> bool:
    """The model's projections as int4 straight from a GGUF's Q4_1 blocks (engine/gguf_blocks.py),
    in place, before the rest of the checkpoint loads; False (nothing changed) unless the blocks are
    every projection's."""
    llama: Any = model  # engine/models/llama.py's LlamaForCausalLM
    fused = fuse_shards(blocks, llama.param_name_of, Q4Blocks.concat)
    wanted = {
        (f"{prefix}.{name}", tuple(getattr(module, name).shape))
        for prefix, module in model.named_modules()
        for name in PROJECTIONS.get(type(module).__name__, ())
    }
    if wanted != {(name, tuple(b.q.shape)) for name, b in fused.items()}:
        return False

    def form(name: str, weight: torch.Tensor) -> Projection:
        b = fused[name]
        return PackedInt4Weight.of(b.q, b.d.float(), b.m.float(), GROUP, gemm)

    replace_projections(model, form)
    return True


def projection_weights(model: nn.Module) -> list[Projection]:
    """The model's projection weights, in their served forms."""
    return [
        getattr(module, name)
        for module in model.modules()
        for name in PROJECTIONS.get(type(module).__name__, ())
    ]


def fuse_shards(
    parts: dict[str, _Part],
    map_name: Callable[[str], tuple[str, int | None] | None],
    concat: Callable[[list[_Part]], _Part],
) -> dict[str, _Part]:
    """HF-named parts (q_proj, k_proj, ...: a checkpoint's grids, a GGUF's blocks) -> the model's
    fused projections' (qkv_proj, ...), each the concatenation of its shards in order."""
    shards: dict[str, dict[int, _Part]] = {}
    for hf_name, part in parts.items():
        mapped = map_name(hf_name)
        if mapped is None:
            continue
        name, shard = mapped
        shards.setdefault(name, {})[shard or 0] = part
    return {name: concat([found[i] for i in sorted(found)]) for name, found in shards.items()}
