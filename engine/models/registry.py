"""Architecture name -> model class."""

from __future__ import annotations

from engine.layers.backend import TORCH_BACKEND, KernelBackend
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.models.llama import LlamaForCausalLM
from engine.parallel.group import TensorParallelGroup

# Mistral, Qwen2 and Qwen3 differ from Llama only in flags ModelConfig carries (QKV bias, q/k norm).
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    backend: KernelBackend = TORCH_BACKEND,
    tp: TensorParallelGroup | None = None,
    full_vocab: int | None = None,
) -> LlamaForCausalLM:
    """An uninitialised model of the config's architecture (weights are loaded afterwards); with
    `tp`, this rank's share (`cfg` as sharded, `full_vocab` the model's whole vocabulary)."""
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class for architecture {cfg.architecture!r}")
    return cls(cfg, max_positions, backend, tp, full_vocab)
