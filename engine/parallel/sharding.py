"""Megatron-style sharding of the Llama family: what one rank's model holds and loads.

Column-parallel (each rank a slice of the outputs): the fused QKV and gate/up projections (and their
biases). Row-parallel (a slice of the inputs; the ranks' outputs summed by one all-reduce): the
output and down projections (their biases held by rank 0, zeros elsewhere, so that the sum adds
them once). Vocabulary-parallel: the embedding and the LM head (rows split, the
last rank padded). KV heads are split across ranks, or, with fewer KV heads than ranks, each rank
holds the one its query heads read. Norms are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.layers.kv_cache import kv_heads_per_rank
from engine.models.config import ModelConfig
from engine.prequantized import read_checkpoint_quant


def check_unquantized(config: EngineConfig, model_dir: Path) -> None:
    """ValueError unless the weights are served unquantized: what tensor parallelism shards."""
    if config.quantization is not None or read_checkpoint_quant(model_dir) is not None:
        raise ValueError("tensor_parallel_size > 1 serves unquantized checkpoints for now")


def check_divisible(mc: ModelConfig, size: int) -> None:
    """ValueError unless the model splits evenly over `size` ranks."""
    if mc.num_heads % size or mc.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's {mc.num_heads} attention heads and "
            f"its MLP width {mc.intermediate_size}"
        )
    kv = mc.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide the other"
        )


def local_config(mc: ModelConfig, size: int) -> ModelConfig:
    """The model as one rank of `size` holds it (heads, KV heads, MLP width, vocabulary rows)."""
    check_divisible(mc, size)
    return dataclasses.replace(
        mc,
        num_heads=mc.num_heads // size,
        num_kv_heads=kv_heads_per_rank(mc.num_kv_heads, size),
        intermediate_size=mc.intermediate_size // size,
        vocab_size=-(-mc.vocab_size // size),
    )


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], mc: ModelConfig, rank: int, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full checkpoint's tensors cut to rank `rank`'s share (`mc`: the whole model)."""
    hd = mc.head_dim
    q_rows = (mc.num_heads // size) * hd
    kv_heads = kv_heads_per_rank(mc.num_kv_heads, size)
    first_kv = rank * kv_heads if mc.num_kv_heads >= size else rank * mc.num_kv_heads // size
    inter = mc.intermediate_size // size
    vocab = -(-mc.vocab_size // size)
    for name, tensor in weights:
        leaf = name.rsplit(".", 2)
        kind = leaf[-2] if len(leaf) >= 2 else ""
        if kind in ("o_proj", "down_proj") and tensor.dim() == 1:  # a row-parallel bias: added once
            yield name, tensor if rank == 0 else torch.zeros_like(tensor)
        elif kind == "q_proj":
            yield name, tensor[rank * q_rows : (rank + 1) * q_rows]
        elif kind in ("k_proj", "v_proj"):
            yield name, tensor[first_kv * hd : (first_kv + kv_heads) * hd]
        elif kind == "o_proj":
            yield name, tensor[:, rank * q_rows : (rank + 1) * q_rows]
        elif kind in ("gate_proj", "up_proj"):
            yield name, tensor[rank * inter : (rank + 1) * inter]
        elif kind == "down_proj":
            yield name, tensor[:, rank * inter : (rank + 1) * inter]
        elif kind in ("embed_tokens", "lm_head"):
            rows = tensor[rank * vocab : (rank + 1) * vocab]
            if rows.shape[0] < vocab:  # the last rank's padding rows: never chosen (see compute_logits)
                rows = torch.cat((rows, rows.new_zeros(vocab - rows.shape[0], rows.shape[1])))
            yield name, rows
        else:
            yield name, tensor
