"""Architecture name -> model class."""

from __future__ import annotations

from engine.layers.backend import TORCH_BACKEND, KernelBackend
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.models.llama import LlamaForCausalLM

# Mistral, Qwen2 and Qwen3 differ from Llama only in flags ModelConfig carries (QKV bias, q/k norm).
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig, max_positions: int, backend: KernelBackend = TORCH_BACKEND
) -> LlamaForCausalLM:
    """An uninitialised model of the config's architecture (weights are loaded afterwards)."""
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class for architecture {cfg.architecture!r}")
    return cls(cfg, max_positions, backend)
