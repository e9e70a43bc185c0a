"""Paged attention layer and the per-step metadata it reads (passed as an argument)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.backend import TORCH_BACKEND, KernelBackend
from engine.layers.kv_cache import LayerKVCache
from kernels import reference


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the KV cache and what each one attends to.

    The flattened batch holds the decode tokens first (one per sequence), then the prefill
    (or prefill-chunk) tokens of each sequence in turn.
    """

    num_actual_tokens: int  # the batch may be padded past this (padding rows attend to nothing)
    slot_mapping: torch.Tensor  # (num_actual_tokens,) int64; -1 for a padding token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    decode_context_lens: torch.Tensor  # (num_decodes,) int32; 0 for a padding row
    prefill_cu_seqlens: torch.Tensor  # (num_prefills + 1,) int32, offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # (num_prefills,) int32
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks) int32
    batch_invariant: bool = False  # bit-identical results whatever the batch and chunking (torch)
    decode_plan: reference.DecodePlan | None = None  # torch: decode layout shared by all layers
    decode_num_splits: int = 1  # triton: KV splits per decode sequence (fixed per CUDA graph)
    prefill_max_query_len: int = 0  # triton: longest prefill chunk (sizes the grid)
    # the C attention block for every row (batch-invariant CPU backend, `every_row`): each of the
    # num_actual_tokens rows' block table (rows, max_blocks) int32 and context length (rows,) int32
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Stores this step's K/V in the layer's paged pool, then attends through block tables."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: KernelBackend = TORCH_BACKEND
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        if backend.is_triton:  # imported only when asked for: the CPU path never loads Triton
            from kernels.paged_attention import paged_decode_attention
            from kernels.prefill_attention import paged_prefill_attention

            self._triton_decode = paged_decode_attention
            self._triton_prefill = paged_prefill_attention

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: (num_tokens, heads, dim); k, v: (num_tokens, kv_heads, dim) -> (num_tokens, heads, dim)."""
        n = meta.num_actual_tokens
        if n < q.shape[0]:
            out = self._attend(q[:n], k[:n], v[:n], kv_cache, meta)
            return torch.cat((out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))), dim=0)
        return self._attend(q, k, v, kv_cache, meta)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.backend.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        nd = meta.num_decode_tokens
        parts = []
        if nd > 0:
            parts.append(self._decode(q[:nd], cache, meta))
        if nd < q.shape[0]:
            parts.append(self._prefill(q[nd:], cache, meta))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _decode(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.backend.is_triton:
            return self._triton_decode(
                q,
                cache.k,
                cache.v,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                num_splits=meta.decode_num_splits,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
            )
        return reference.paged_decode_attention(
            q,
            cache.k,
            cache.v,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
            meta.batch_invariant,
            meta.decode_plan,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )

    def _prefill(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.backend.is_triton:
            return self._triton_prefill(
                q,
                cache.k,
                cache.v,
                meta.prefill_cu_seqlens,
                meta.prefill_context_lens,
                meta.prefill_block_tables,
                self.scale,
                max_query_len=meta.prefill_max_query_len or None,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
            )
        return reference.paged_prefill_attention(
            q,
            cache.k,
            cache.v,
            meta.prefill_cu_seqlens,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            self.scale,
            meta.batch_invariant,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )
