"""`python -m engine plan`: what a model needs on a device before anything is started.

Weights per device, KV bytes per token, the KV blocks and tokens that fit, and how many sequences of
a given context length run at once. KV sizing is the engine's own (`kv_bytes_per_block`, the number
of blocks a budget holds), so on the CPU with `--memory-gib` (the engine's `kv_cache_memory`) the
plan is exactly what the engine allocates. On a GPU the budget follows the engine's formula
(`gpu_kv_budget`: the allowed share of the device, less weights, the CUDA context and the
activation peak), with the peak estimated here where the engine measures it at start-up.

With `tensor_parallel_size` N (Megatron-style, as the engine shards): QKV, gate/up, output and
down projections and the vocabulary (embedding, LM head) are split N ways; norms are replicated; KV
heads are split, or replicated when there are fewer KV heads than ranks.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.gguf_blocks import BLOCKS_FILE
from engine.kv_sizing import gpu_kv_budget, kv_bytes_per_block
from engine.layers.kv_cache import kv_heads_per_rank
from engine.model_runner import TORCH_DTYPES
from engine.models.config import ModelConfig

GIB = 1 << 30
FOUR_BIT = ("int4", "awq", "gptq")  # GPTQ checkpoints are planned as 4-bit (8-bit ones: as int8)
PLAN_QUANTIZATIONS = ("int8", "int4", "w8a8", "awq", "gptq", "fp8")
# nvidia-smi's total memory (MiB) of common GPUs; --memory-gib for anything else
GPUS_MIB = {
    "H100": 81559,
    "H100-NVL": 95830,
    "H200": 143771,
    "A100-80G": 81920,
    "A100-40G": 40960,
    "L40S": 46068,
    "L4": 23034,
    "A10G": 23028,
    "RTX4090": 24564,
    "T4": 15360,
}
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context and allocator's own use, before any tensor
MAX_SUGGESTED_SEQS = 256  # past this a step is compute-bound: more sequences only wait their turn


@dataclass(frozen=True)
class PlanRow:
    """One context length: blocks a sequence needs and how many such sequences fit at once."""

    context_len: int
    blocks_per_seq: int
    max_concurrent_seqs: int


@dataclass(frozen=True)
class Plan:
    """What one rank of a model needs and holds (bytes), and the sequences that fit."""

    model: str
    device: str
    device_bytes: int
    tensor_parallel_size: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    weight_bytes_per_device: int
    kv_bytes_per_token: int  # one rank, every layer
    kv_budget_bytes: int
    block_size: int
    num_blocks: int
    rows: tuple[PlanRow, ...]
    suggested_max_num_seqs: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.num_blocks * self.block_size


def weight_bytes(
    mc: ModelConfig, dtype: str, quantization: str | None, tp: int = 1, half_int4_scales: bool = False
) -> int:
    """Bytes of one rank's weights (quantized forms: codes plus their scales, as the engine keeps them;
    `half_int4_scales`: 4-bit groups keep float16 scales and offsets, as the CPU's C product does for
    a GGUF's Q4_1 blocks)."""
    width = TORCH_DTYPES[dtype].itemsize
    heads, kv_heads = mc.num_heads // tp, kv_heads_per_rank(mc.num_kv_heads, tp)
    hd, hidden, inter = mc.head_dim, mc.hidden_size, mc.intermediate_size // tp
    projections = [  # (inputs, outputs) of one layer's matrices on one rank
        (hidden, (heads + 2 * kv_heads) * hd), (heads * hd, hidden), (hidden, 2 * inter), (inter, hidden)
    ]  # fmt: skip
    per_layer = sum(_matrix_bytes(i, o, width, quantization, half_int4_scales) for i, o in projections)
    per_layer += 2 * hidden * width  # the two norms
    if mc.qkv_bias:
        per_layer += (heads + 2 * kv_heads) * hd * width
    per_layer += (int(mc.o_bias) + int(mc.mlp_bias)) * hidden * width + int(mc.mlp_bias) * 2 * inter * width
    if mc.qk_norm:
        per_layer += 2 * hd * width
    vocab = -(-mc.vocab_size // tp)
    embedding = vocab * hidden * width
    # a tied head is the table itself, except under quantization: an int8 copy beside the float table
    tied = mc.tie_word_embeddings and quantization is None
    head = 0 if tied else _matrix_bytes(hidden, vocab, width, _head_form(quantization))
    return mc.num_layers * per_layer + embedding + head + hidden * width


def _head_form(quantization: str | None) -> str | None:
    """The LM head's form: int8 under every weight quantization (int4 keeps it in int8)."""
    return None if quantization is None else "int8"


def _matrix_bytes(inputs: int, outputs: int, width: int, quantization: str | None, half: bool = False) -> int:
    if quantization is None:
        return inputs * outputs * width
    # 4-bit codes, a float32 (float16: `half`) scale and offset per 32 inputs of a row
    if quantization in FOUR_BIT:
        return inputs * outputs // 2 + -(-inputs // 32) * outputs * (4 if half else 8)
    return inputs * outputs + outputs * 4  # int8 / w8a8 / 8-bit checkpoints: a float32 scale per row


def activation_peak_bytes(mc: ModelConfig, dtype: str, tokens: int, max_num_seqs: int, tp: int = 1) -> int:
    """An estimate of the largest step's activations on one rank: the MLP's gate/up, its product, and
    a few hidden-sized tensors per token, plus float32 logits for the sampled rows."""
    per_token = 3 * mc.intermediate_size // tp + 6 * mc.hidden_size + (mc.num_heads // tp) * mc.head_dim
    return tokens * per_token * TORCH_DTYPES[dtype].itemsize + max_num_seqs * mc.vocab_size * 4


def make_plan(
    model: str,
    mc: ModelConfig,
    *,
    gpu: str | None = None,
    memory_gib: float | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    context_lens: tuple[int, ...] = (),
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    gguf_blocks: bool = False,
) -> Plan:
    """The plan for one rank. CPU (no `gpu`): `memory_gib` is the KV pool (`kv_cache_memory`, 1 GiB
    when unset); GPU: `gpu` by name or `memory_gib` of device memory, shared as the engine shares it.
    `gguf_blocks`: the folder keeps a GGUF's Q4_1 blocks (engine/gguf_blocks.py), which int4 on the
    CPU serves with their float16 scales."""
    tp = tensor_parallel_size
    if tp < 1 or mc.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {mc.num_heads} attention heads")
    on_gpu = gpu is not None
    if gpu is not None and gpu not in GPUS_MIB:
        raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS_MIB)}, or give --memory-gib")
    dtype = ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype
    half = gguf_blocks and not on_gpu and tp == 1 and quantization == "int4"
    weights = weight_bytes(mc, dtype, quantization, tp, half)
    per_block = kv_bytes_per_block(mc, block_size, TORCH_DTYPES[dtype], kv_cache_dtype, tp)
    if gpu is not None:
        total = GPUS_MIB[gpu] << 20 if memory_gib is None else int(memory_gib * GIB)
        free = total - CUDA_CONTEXT_BYTES - weights
        peak = activation_peak_bytes(mc, dtype, max_num_batched_tokens, max_num_seqs, tp)
        budget = max(0, gpu_kv_budget(total, free, gpu_memory_utilization, peak))
        device = f"{gpu} ({total / GIB:.1f} GiB)"
    else:
        total = budget = int((memory_gib if memory_gib is not None else 1.0) * GIB)
        device = f"CPU, kv_cache_memory {budget / GIB:g} GiB"
    num_blocks = budget // per_block  # as plan_kv_cache counts them
    lens = sorted(set(context_lens)) or _default_lengths(mc.max_position_embeddings)
    rows = tuple(PlanRow(n, -(-n // block_size), num_blocks // -(-n // block_size)) for n in lens if n >= 1)
    longest = rows[-1].max_concurrent_seqs if rows else 0
    return Plan(
        model, device, total, tp, dtype, quantization, kv_cache_dtype, weights, per_block // block_size,
        budget, block_size, num_blocks, rows, max(1, min(longest, MAX_SUGGESTED_SEQS)),
    )  # fmt: skip


def _default_lengths(max_len: int) -> list[int]:
    """Powers of two from 2,048 to the model's context, and the context itself."""
    lens = [n for n in (2048, 4096, 8192, 16384, 32768, 65536, 131072) if n < max_len]
    return [*lens, max_len]


def render(plan: Plan) -> str:
    """The plan as a table for people."""

    def gib(n: int) -> str:
        return f"{n / GIB:.2f} GiB"

    lines = [
        f"model {plan.model} on {plan.device}, tensor_parallel_size {plan.tensor_parallel_size}",
        f"dtype {plan.dtype}, quantization {plan.quantization or 'none'}, "
        f"kv_cache_dtype {plan.kv_cache_dtype}",
        f"weights per device      {gib(plan.weight_bytes_per_device)}",
        f"KV bytes per token      {plan.kv_bytes_per_token:,} per device "
        f"({plan.kv_bytes_per_token * plan.tensor_parallel_size:,} over {plan.tensor_parallel_size} rank(s))",
        f"KV pool                 {gib(plan.kv_budget_bytes)}: {plan.num_blocks:,} blocks of "
        f"{plan.block_size} = {plan.kv_tokens:,} tokens",
        "",
        f"{'context length':>15} {'blocks/seq':>11} {'max concurrent sequences':>25}",
    ]
    lines += [f"{r.context_len:>15,} {r.blocks_per_seq:>11,} {r.max_concurrent_seqs:>25,}" for r in plan.rows]
    longest = plan.rows[-1].context_len if plan.rows else 0
    lines += ["", f"suggested max_num_seqs  {plan.suggested_max_num_seqs} (at {longest:,} tokens each)"]
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    """The plan as JSON (every figure in bytes or counts)."""
    data: dict[str, Any] = asdict(plan)
    data["kv_tokens"] = plan.kv_tokens
    return json.dumps(data, indent=2)


def load_model_config(model: str) -> ModelConfig:
    """A model folder, `default`, or a config.json file (to plan for a model not downloaded)."""
    path = Path(model)
    if path.is_file():
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    from engine.default_model import resolve_model

    return ModelConfig.from_dir(resolve_model(model))


def model_folder(model: str) -> Path | None:
    """The folder `model` names (None for a bare config.json)."""
    if Path(model).is_file():
        return None
    from engine.default_model import resolve_model

    return resolve_model(model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m engine plan`'s flags."""
    parser.add_argument("--model", default="default", help="a model folder, 'default', or a config.json")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", choices=list(GPUS_MIB), help="plan for this GPU (nvidia-smi's memory)")
    parser.add_argument(
        "--memory-gib", type=float, default=None,
        help="with --gpu: the device's memory instead of the named one's; alone: the CPU KV pool "
        "(kv_cache_memory; 1 GiB when unset)",
    )  # fmt: skip
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=PLAN_QUANTIZATIONS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    parser.add_argument(
        "--context-len", type=int, action="append", default=None,
        help="tokens per sequence (prompt + output); repeat for several rows (default: 2k.. the model's)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the plan; 2 with a message for settings that cannot be planned."""
    try:
        mc = load_model_config(args.model)
        folder = model_folder(args.model)
        plan = make_plan(
            args.model, mc, gpu=args.gpu, memory_gib=args.memory_gib,
            tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            context_lens=tuple(args.context_len or ()), block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            gguf_blocks=folder is not None and (folder / BLOCKS_FILE).is_file(),
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    print(to_json(plan) if args.json else render(plan))
    return 0
