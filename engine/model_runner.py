"""ModelRunner: owns the model and the KV pools; turns a scheduled step into logits."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.config import EngineConfig, kernel_cache_dir
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.kv_sizing import KVCompanion, plan_kv_cache
from engine.layers import kv_cache
from engine.layers.attention import AttentionMetadata
from engine.layers.backend import load_backend, resolve_backend_name
from engine.layers.cpu_blas import batch_invariant_linear
from engine.layers.packed import rows_alone, use_packed_int8, use_packed_weights
from engine.layers.weight_loading import load_weights
from engine.models.config import ModelConfig
from engine.models.fused_stack import fuse_stack
from engine.models.registry import build_model
from engine.parallel.group import TensorParallelGroup
from engine.parallel.sharding import check_unquantized, local_config, shard_weights
from engine.parallel.workers import rebuild, step_inputs
from engine.scheduler import ScheduledSeq
from engine.weights import iter_weights
from kernels import cpu_native
from kernels.reference import ROW_MULTIPLE, plan_decode
from kernels.split_kv import choose_num_splits

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    """`auto` means CUDA when available, else CPU; a CUDA device always with its index (the current
    device for plain `cuda`: torch.cuda.set_device refuses a device without one)."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (exact and fast there), bfloat16 on GPU."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[config.dtype]


class ModelRunner:
    """Loads weights, allocates one KV pool per layer and runs the flattened batch of a step."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: Path,
        max_model_len: int,
        tp: TensorParallelGroup | None = None,
        companion: KVCompanion | None = None,
    ) -> None:
        """`tp`: this process's rank of a tensor-parallel engine; it then holds its share of the
        model (engine/parallel/sharding.py) and of every layer's KV pool. `companion`: what a draft
        model loaded next will take of the GPU (plan_kv_cache leaves room for it)."""
        self.tp = tp
        full_vocab = model_config.vocab_size
        if tp is not None:
            check_unquantized(config, model_dir)
            model_config = local_config(model_config, tp.size)
        self.device = resolve_device(config)
        if self.device.type == "cuda":  # Triton and graph capture use the current device
            torch.cuda.set_device(self.device)
            if config.kv_cache_dtype == "fp8_e4m3" and torch.cuda.get_device_capability(self.device) < (8, 9):
                raise ValueError(
                    "kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability 8.9 or newer (fp8 "
                    "conversions): use 'int8'"
                )
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        backend_name = resolve_backend_name(config.attention_backend, self.device)
        # bit-identical batching is a property of the torch CPU path (see kernels/reference.py)
        self.batch_invariant = config.batch_invariant and backend_name != "triton"
        if self.batch_invariant and self.device.type == "cpu":
            self.batch_invariant = batch_invariant_linear(self.dtype, model_config.hidden_size, ROW_MULTIPLE)
        invariant = self.batch_invariant or self.device.type != "cpu"
        on_cpu = self.device.type == "cpu" and backend_name == "torch" and self.dtype == torch.float32
        cpu = cpu_native.load(kernel_cache_dir()) if on_cpu else None
        self.backend = load_backend(backend_name, invariant, cpu)
        self._pad_rows = self.batch_invariant or self.device.type != "cpu"
        self.model_config = model_config
        self.config = config
        self.max_model_len = max_model_len
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # parameters born in their dtype: no fp32 copy on the GPU
        try:
            with torch.device(self.device):
                model = build_model(model_config, max_model_len, self.backend, tp, full_vocab)
        finally:
            torch.set_default_dtype(default_dtype)
        model.to(dtype=self.dtype)
        if tp is not None:  # the whole checkpoint read, this rank's share kept
            full = ModelConfig.from_dir(model_dir)
            model.load_weights(shard_weights(iter_weights(model_dir, self.dtype), full, tp.rank, tp.size))
            self.quantization = None
        else:
            calibrate = lambda tokens: self._prefill_alone(model, tokens)  # noqa: E731 - w8a8's smoothing
            gemm = cpu.gemm if cpu is not None and cpu.gemm.vectorized else None
            # quantized weights in the Triton kernels' forms on any GPU (torch's packed-int ones are
            # CPU kernels), whichever attention backend runs
            triton_weights = self.backend.is_triton or self.device.type == "cuda"
            self.quantization = load_weights(model, model_dir, config, triton_weights, calibrate, gemm)
            if gemm is not None:  # float32, int8 and int4 products on the C kernel
                if self.quantization is None:
                    use_packed_weights(model, gemm)
                else:
                    use_packed_int8(model, gemm)
                # each row of those products alone: no padding to MKL's row multiple needed
                self._pad_rows = self._pad_rows and not rows_alone(model)
        self.model = model.eval()
        peak = self.profile_activation_peak() if self.device.type == "cuda" else 0
        self.layout = plan_kv_cache(config, model_config, self.dtype, self.device, peak, companion)
        self.kv_caches = [self.allocate_kv(self.layout.num_blocks) for _ in range(model_config.num_layers)]
        if cpu is not None and tp is None:  # every layer's kernels in C: the stack as one call
            self.model.fused = fuse_stack(self.model, cpu.stack, self.kv_caches)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %s); kernels: %s",
            self.layout.num_blocks,
            config.block_size,
            self.layout.num_blocks * self.layout.bytes_per_block / 2**20,
            self.kv_cache_dtype(),
            self.backend.name,
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.backend.is_triton and not config.enforce_eager and tp is None:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                graph_batch_sizes(config.max_num_seqs),
                max_blocks_per_seq=-(-max_model_len // config.block_size),
                num_kv_heads=model_config.num_kv_heads,
                max_model_len=max_model_len,
            )

    @torch.inference_mode()
    def _prefill_alone(self, model: torch.nn.Module, tokens: list[int]) -> None:
        """One prefill of `tokens` (at most max_model_len of them) over a pool of its own
        (load-time calibration, before the KV pool is planned)."""
        tokens = tokens[: self.max_model_len]
        num_blocks = -(-len(tokens) // self.block_size)
        seq: Any = SimpleNamespace(token_ids=tokens, num_computed_tokens=0, num_tokens=len(tokens))
        seq.block_table = list(range(num_blocks))
        input_ids, positions, meta, _ = self.prepare([ScheduledSeq(seq, len(tokens))])
        pool = [self.allocate_kv(num_blocks) for _ in range(self.model_config.num_layers)]
        model(input_ids, positions, pool, meta)

    def allocate_kv(self, num_blocks: int) -> kv_cache.LayerKVCache:
        """One layer's zeroed pool of num_blocks blocks, stored as kv_cache_dtype says."""
        mc = self.model_config
        return kv_cache.allocate(
            num_blocks,
            self.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.config.kv_cache_dtype,
            self.device,
        )

    def kv_cache_dtype(self) -> str:
        """What the KV pool stores: the model's dtype, or int8 / fp8_e4m3 codes."""
        if self.config.kv_cache_dtype == "auto":
            return str(self.dtype).removeprefix("torch.")
        return self.config.kv_cache_dtype

    def precision(self) -> dict[str, str | bool | None]:
        """What this runner serves: weight dtype, weight quantization, KV cache, batch invariance."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype(),
            "batch_invariant": self.batch_invariant,
        }

    @torch.inference_mode()
    def profile_activation_peak(self) -> int:
        """Peak bytes a full prefill step allocates beyond the weights (CUDA), found by running one
        over dummy tokens: max_num_batched_tokens split into sequences of at most max_model_len,
        against a one-block KV pool that nothing is written to (every slot is padding)."""
        dev = self.device
        input_ids, positions, dummy_kv, meta = self.dummy_prefill()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        hidden = self.model(input_ids, positions, dummy_kv, meta)
        self.model.compute_logits(hidden[: self.config.max_num_seqs])  # the sampler's logits too
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del hidden, dummy_kv
        torch.cuda.empty_cache()
        logger.info("profiled activation peak: %.1f MiB", peak / 2**20)
        return int(peak)

    def dummy_prefill(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, list[kv_cache.LayerKVCache], AttentionMetadata]:
        """The largest prefill step: (input ids, positions, a one-block KV pool, metadata)."""
        dev, mc = self.device, self.model_config
        total = self.config.max_num_batched_tokens
        seq_len = min(self.max_model_len, total)
        lens = [seq_len] * (total // seq_len) + ([total % seq_len] if total % seq_len else [])
        block = self.allocate_kv(1)
        dummy_kv = [block] * mc.num_layers
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            num_actual_tokens=total,
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            prefill_block_tables=torch.zeros(
                (len(lens), -(-seq_len // self.block_size)), dtype=torch.int32, device=dev
            ),
            prefill_max_query_len=seq_len,
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        return torch.zeros(total, dtype=torch.int64, device=dev), positions, dummy_kv, meta

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten a step into (input_ids, positions, attention metadata, indices of tokens to sample)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        pre_tables: list[list[int]] = []
        pre_lens: list[int] = []
        cu = [0]
        num_decode = 0
        seq_tables: list[list[int]] = []  # every row's attention in C (`every_row`): each row's table
        row_seq: list[int] = []
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end] if not s.spec_tokens else seq.token_ids[start:])
            input_ids.extend(s.spec_tokens)  # drafts after the last token: verified in this pass
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.is_decode:
                num_decode += 1
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu.append(cu[-1] + s.num_new_tokens)
            sample_idx.extend(range(len(input_ids) - s.num_sampled_rows, len(input_ids)))
            if self.backend.every_row:
                row_seq.extend([len(seq_tables)] * (end - start))
                seq_tables.append(table)
        dev = self.device
        num_actual = len(input_ids)
        row_tables = row_lens = None
        if self.backend.every_row:  # a row attends to its sequence's table up to its own position
            row_tables = _pad_tables(seq_tables, dev)[torch.tensor(row_seq, dtype=torch.int64)]
            row_lens = torch.tensor(positions, dtype=torch.int32) + 1
        # Batch-invariant on MKL's products (no C product here, or int4/w8a8 weights): round the
        # batch up to a multiple of 4 rows (where MKL's strict mode is not on, GEMMs with such row
        # counts give each row the same bits whatever the batch). The C product over packed weights
        # computes each row alone, and otherwise a CPU step computes its own rows only: a 4-row
        # product costs 1.8x a 1-row one.
        padding = -num_actual % ROW_MULTIPLE if self._pad_rows else 0
        input_ids.extend([0] * padding)
        positions.extend([0] * padding)
        dec_block_tables = _pad_tables(dec_tables, dev)
        dec_context_lens = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
        plan = None
        num_splits = 1
        if num_decode and self.backend.is_triton:
            # on the GPU from the longest possible context, as the CUDA graphs do (a batch of a
            # captured size splits alike either way); the interpreter pays per program: actual one
            longest = self.max_model_len if self.device.type == "cuda" else max(dec_lens)
            num_splits = choose_num_splits(num_decode, self.model_config.num_kv_heads, longest, self.device)
        elif num_decode and not self.backend.every_row:
            plan = plan_decode(
                dec_block_tables,
                dec_context_lens,
                self.kv_caches[0].k,
                self.model_config.num_heads,
                self.batch_invariant,
                self.dtype,
            )
        meta = AttentionMetadata(
            num_actual_tokens=num_actual,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=num_decode,
            decode_block_tables=dec_block_tables,
            decode_context_lens=dec_context_lens,
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(pre_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables(pre_tables, dev),
            batch_invariant=self.batch_invariant,
            decode_plan=plan,
            decode_num_splits=num_splits,
            prefill_max_query_len=max((b - a for a, b in itertools.pairwise(cu)), default=0),
            row_block_tables=row_tables,
            row_context_lens=row_lens,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(sample_idx, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits (sampled rows, vocab) in scheduled order: one row per
        sampling sequence, 1 + its drafts for a speculating one."""
        if self.graphs is not None and self.graphs.can_run(scheduled):
            hidden = self.graphs.run(scheduled, self.block_size)
            if not all(s.samples for s in scheduled):  # a one-token prompt chunk samples nothing
                keep = [i for i, s in enumerate(scheduled) if s.samples]
                hidden = hidden[torch.tensor(keep, dtype=torch.int64, device=hidden.device)]
            return self.model.compute_logits(hidden).float()
        if self.tp is not None:  # every rank runs the same batch over its shard
            self.tp.broadcast(step_inputs(scheduled))
        return self._forward(scheduled)

    def follow_driver(self) -> None:
        """A worker rank's loop: run each step the driver broadcasts, until it sends None."""
        assert self.tp is not None and not self.tp.is_driver
        with torch.inference_mode():
            while (steps := self.tp.broadcast(None, idle=True)) is not None:
                self._forward(rebuild(steps))

    def release_workers(self) -> None:
        """The driver's last word to the worker ranks: they leave `follow_driver` and exit."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.broadcast(None)

    def _forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        input_ids, positions, meta, sample_idx = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        num_sampled = sample_idx.shape[0]
        if self._pad_rows and num_sampled % ROW_MULTIPLE:  # the batch's row rounding, for the LM head
            pad = sample_idx.new_zeros(ROW_MULTIPLE - num_sampled % ROW_MULTIPLE)
            sample_idx = torch.cat((sample_idx, pad))
        return self.model.compute_logits(hidden[sample_idx])[:num_sampled]


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    ).reshape(len(tables), width)
