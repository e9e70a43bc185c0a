"""CUDA graphs for decode steps: one graph per padded batch size, replayed with fresh inputs.

A decode step launches a few hundred small kernels; on the GPU their launch overhead, not the
arithmetic, bounds a small batch. Capturing the whole forward once per batch size and replaying
it removes that cost. Everything a graph reads lives in static buffers that each step refills:
padding rows get slot -1 (nothing stored) and context length 0 (zeros out), and the attention
split count depends only on the batch size, never on the context lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.kv_cache import LayerKVCache
from engine.scheduler import ScheduledSeq
from kernels.split_kv import choose_num_splits

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, ... up to max_num_seqs, which is always included."""
    sizes = []
    n = 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured size that holds n sequences (None: run eagerly)."""
    for size in sizes:
        if size >= n:
            return size
    return None


class DecodeGraphs:
    """Captured decode forwards, one per batch size, sharing one memory pool and input buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[LayerKVCache],
        sizes: list[int],
        max_blocks_per_seq: int,
        num_kv_heads: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.capture = capture  # False: replay runs the forward eagerly on the same buffers (tests)
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        device = kv_caches[0].device
        self.device = device
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((top, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _meta(self, size: int) -> AttentionMetadata:
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            num_actual_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=self.device),
            prefill_context_lens=empty,
            prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=self.device),
            # from the batch size and the longest possible context: valid for every replay
            decode_num_splits=choose_num_splits(size, self.num_kv_heads, self.max_model_len, self.device),
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            meta = self._meta(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                self.model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, scheduled: list[ScheduledSeq]) -> bool:
        """A pure decode step no larger than the largest captured batch."""
        return 0 < len(scheduled) <= self.sizes[-1] and all(s.is_decode for s in scheduled)

    def run(self, scheduled: list[ScheduledSeq], block_size: int) -> torch.Tensor:
        """Replay the graph for this decode step; returns hidden states (len(scheduled), hidden)."""
        n = len(scheduled)
        size = padded_batch_size(self.sizes, n)
        assert size is not None
        ids, pos, slots, lens = [], [], [], []
        width = max(len(s.seq.block_table) for s in scheduled)
        rows: list[list[int]] = []
        for s in scheduled:
            seq = s.seq
            p = seq.num_computed_tokens  # the one new token's position
            table = seq.block_table
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            lens.append(p + 1)
            rows.append(table + [0] * (width - len(table)))
        pad = size - n
        tables = torch.tensor(rows, dtype=torch.int32)
        # one host->device copy per buffer; padding rows store nothing and read nothing
        self.input_ids[:size].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.context_lens[:size].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        out: torch.Tensor = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size)
        )
        return out[:n]
