"""Llama-family decoder (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with q/k norm) over paged KV.

Llama's `attention_bias` / `mlp_bias` and Qwen3's `attention_bias` give the output, gate/up and
down projections biases too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.backend import TORCH_BACKEND, KernelBackend
from engine.layers.kv_cache import LayerKVCache
from engine.layers.norm import RMSNorm
from engine.layers.packed import PackedWeight
from engine.layers.quant import Projection
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig
from engine.parallel.group import TensorParallelGroup
from kernels import cpu_decode
from kernels.cpu_decode import BoundAttention

if TYPE_CHECKING:
    from engine.models.fused_stack import FusedStack

# HF checkpoint name -> (our fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _linear_weight(out_features: int, in_features: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def _bias(features: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(features), requires_grad=False)


_LOGITS_CHUNK = 1024  # vocabulary rows per LM-head GEMM on CPU


class Attention(nn.Module):
    """Self-attention with fused QKV projection, RoPE and paged KV."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: KernelBackend,
        tp: TensorParallelGroup | None,
    ) -> None:
        super().__init__()
        self.tp = tp  # row-parallel o_proj: the ranks' partial outputs are summed
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = _linear_weight(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _bias(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_proj = _linear_weight(cfg.hidden_size, self.q_size)
        # under tensor parallelism rank 0 holds it and the others zeros (the ranks' outputs are summed)
        self.o_bias = _bias(cfg.hidden_size) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend)
        self.linear = backend.linear
        fits = not cfg.qk_norm and cpu_decode.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.cpu_decode = backend.cpu_decode if fits else None
        self._bound: tuple[tuple[int, int], BoundAttention] | None = None  # (the caches' addresses, it)

    def _c_tables(
        self, qkv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' block tables and context lengths when the C kernel takes this step's attention
        block (every row of every step: the runner gives each row's table), else None: float32
        throughout (a quantized cache's codes and scales stay with the torch path, for every step)."""
        if (
            self.cpu_decode is None
            or meta.row_block_tables is None
            or meta.row_context_lens is None
            or kv_cache.k_scale is not None
            or not kv_cache.k.dtype == qkv.dtype == torch.float32
            or not qkv.is_contiguous()
        ):
            return None
        return meta.row_block_tables, meta.row_context_lens

    def _bound_attention(self, kv_cache: LayerKVCache) -> BoundAttention:
        """The C attention block bound to this layer's caches and rotary tables (checked once)."""
        key = (kv_cache.k.data_ptr(), kv_cache.v.data_ptr())
        if self._bound is None or self._bound[0] != key:
            assert self.cpu_decode is not None
            cos_sin = (self.rotary.cos_cache, self.rotary.sin_cache)
            shape = (self.num_heads, self.num_kv_heads, self.head_dim)
            bound = self.cpu_decode.bind_attention(shape, cos_sin, kv_cache.k, kv_cache.v, self.attn.scale)
            self._bound = (key, bound)
        return self._bound[1]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.linear(x, self.qkv_proj, self.qkv_bias)
        tables = self._c_tables(qkv, kv_cache, meta)
        if tables is not None:
            rows = meta.num_actual_tokens  # rows past it pad a batch: they attend to nothing
            attention = self._bound_attention(kv_cache)
            out = attention(
                qkv if rows == n else qkv[:rows],
                positions if rows == n else positions[:rows],
                meta.slot_mapping,
                *tables,
            )
            if rows != n:
                out = torch.cat((out, out.new_zeros(n - rows, out.shape[1])))
            projected = self.linear(out, self.o_proj, self.o_bias)
            return projected if self.tp is None else self.tp.all_reduce(projected)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        projected = self.linear(out.reshape(n, self.q_size), self.o_proj, self.o_bias)
        return projected if self.tp is None else self.tp.all_reduce(projected)


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, backend: KernelBackend, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp  # row-parallel down_proj: the ranks' partial outputs are summed
        self.silu_and_mul = backend.silu_and_mul
        self.linear = backend.linear
        self.gate_up_proj = _linear_weight(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _linear_weight(cfg.hidden_size, cfg.intermediate_size)
        self.gate_up_bias = _bias(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_bias = _bias(cfg.hidden_size) if cfg.mlp_bias else None  # rank 0's, as o_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(x, self.gate_up_proj, self.gate_up_bias)
        out = self.linear(self.silu_and_mul(gate_up), self.down_proj, self.down_bias)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by pre-norm MLP block.

    The residual stream travels beside the block output, so each residual add is fused into the
    next norm: (h, residual) -> (mlp output, residual before it).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: KernelBackend,
        tp: TensorParallelGroup | None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg, backend, tp)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embeddings are the residual stream
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_norm(h, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; forward runs a flattened batch of tokens."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        backend: KernelBackend = TORCH_BACKEND,
        tp: TensorParallelGroup | None = None,
        full_vocab: int | None = None,
    ) -> None:
        """`cfg`: the model as this rank holds it; under tensor parallelism (`tp`) its share, whose
        vocabulary rows start at rank * cfg.vocab_size of the model's `full_vocab`."""
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.tp = tp
        self.full_vocab = full_vocab or cfg.vocab_size
        self.vocab_start = 0 if tp is None else tp.rank * cfg.vocab_size
        # None once engine/layers/packed.py packs a tied table as the LM head (`head_weight` then
        # serves the lookups too)
        self.embed_tokens: nn.Parameter | None = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False
        )
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, backend)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        )
        # the LM head as a weight that does its own product: quantized (engine.layers.quant's
        # quantize_model) or packed for the CPU kernel (engine.layers.packed)
        self.head_weight: Projection | None = None
        # the layers and final norm as one C call where every piece is a C kernel
        # (engine/models/fused_stack.py; the runner binds it once the caches exist). It reads the
        # weights bound then: whoever replaces a projection afterwards sets it to None
        self.fused: FusedStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """(num_tokens,) ids and positions -> (num_tokens, hidden) final hidden states."""
        h = self._embed(input_ids)
        if self.fused is not None and (out := self.fused(h, positions, kv_caches, meta)) is not None:
            return out
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(positions, h, residual, kv_cache, meta)
        if residual is None:  # no layers
            normed: torch.Tensor = self.norm(h)
            return normed
        out, _ = self.norm.add_norm(h, residual)
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start  # this rank's rows; other ids are another rank's
        mine = (local >= 0) & (local < self.cfg.vocab_size)
        h = self._lookup(local.clamp(0, self.cfg.vocab_size - 1))
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:  # packed as the tied LM head
            assert isinstance(self.head_weight, PackedWeight)
            return self.head_weight.rows(ids)
        return F.embedding(ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_selected, hidden) -> (num_selected, vocab) float32 logits (every rank's share, joined)."""
        logits = self._local_logits(hidden)
        if self.tp is None:
            return logits
        return self.tp.gather_last_dim(logits)[:, : self.full_vocab]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_weight is not None:
            return self.head_weight.matmul(hidden).float()
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        assert weight is not None
        vocab = weight.shape[0]
        if not self.backend.chunked_logits or hidden.device.type != "cpu" or vocab <= 2 * _LOGITS_CHUNK:
            return self.backend.linear(hidden, weight, None).float().contiguous()
        # On CPU one big GEMM streams the whole matrix once per row block; slices that stay in
        # cache while every row uses them run about 25% faster (fixed slices: batch-invariant).
        out = hidden.new_empty(hidden.shape[0], vocab)
        for start in range(0, vocab, _LOGITS_CHUNK):
            end = min(start + _LOGITS_CHUNK, vocab)
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out.float()

    def param_name_of(self, hf_name: str) -> tuple[str, int | None] | None:
        """A checkpoint tensor's (parameter, shard in a fused parameter), or None when not loaded."""
        return _map_weight_name(hf_name, tied=self.lm_head is None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (partly fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        cfg = self.cfg
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        offsets = {
            "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "qkv_bias": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "gate_up_proj": [(0, inter), (inter, 2 * inter)],
            "gate_up_bias": [(0, inter), (inter, 2 * inter)],
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            mapped = _map_weight_name(hf_name, tied=self.lm_head is None)
            if mapped is None:
                continue
            name, shard = mapped
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {cfg.architecture}")
            target = params[name].data
            if shard is not None:
                start, end = offsets[name.rsplit(".", 1)[-1]][shard]
                target = target[start:end]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}[{shard}]")
        expected = {
            f"{n}[{i}]" if n.rsplit(".", 1)[-1] in offsets else n
            for n in params
            for i in range(len(offsets.get(n.rsplit(".", 1)[-1], [None])))
        }
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {sorted(missing)[:3]}")


def _map_weight_name(hf_name: str, tied: bool) -> tuple[str, int | None] | None:
    """HF checkpoint name -> (our parameter name, shard index in a fused parameter); None to skip."""
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name or (name == "lm_head.weight" and tied):
        return None  # recomputed buffers; or the LM head tied to the embedding
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return name.removesuffix(".weight"), None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        fused, shard = _STACKED[parts[-2]]
        leaf = fused.replace("_proj", "_bias") if parts[-1] == "bias" else fused
        return ".".join([*parts[:-2], leaf]), shard
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return name.removesuffix(".weight"), None
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return name.replace("_proj.bias", "_bias"), None
    return name, None
