"""Shared fixtures: the default model folder and tiny random Llama-family models built from configs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.layers.cpu_blas import request_strict_mkl
from gateway.cli.environment import offline_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _name, _value in offline_defaults().items():  # what `python -m gateway` sets: litellm, tiktoken offline
    os.environ.setdefault(_name, _value)
# Without CUDA the Triton kernels run through Triton's CPU interpreter, which reads this when a
# kernel is defined: set it before any test module imports kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# one thread a test process when pytest-xdist runs one per core (make test), else up to two
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
request_strict_mkl()  # before any test calls MKL, as `engine serve` does: row-invariant products

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA 4/2 with Llama-3 rope scaling
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        rope_theta=10000.0,
    ),
    # head count not a power of two (6/2), QKV bias, tied embeddings
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
    # q/k norm, explicit head_dim != hidden / heads, GQA 4/1
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        attention_bias=False,
    ),
    # plain multi-head attention, Mistral naming
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=None,
    ),
}
# Llama with every bias (attention_bias: Q/K/V and output; mlp_bias: gate, up, down) and YaRN RoPE
# stretched 4x from a 64-token original context (the tests' prompts run past it)
TINY_CONFIGS["llama-biased"] = dict(
    TINY_CONFIGS["llama"],
    attention_bias=True,
    mlp_bias=True,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    max_position_embeddings=256,
)
# Qwen3's attention_bias: Q/K/V and output biases beside its q/k norms
TINY_CONFIGS["qwen3-biased"] = dict(TINY_CONFIGS["qwen3"], attention_bias=True)


def build_tiny_model(arch: str, out: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Random weights (sharp enough logits to avoid ties), saved as an HF safetensors folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY_CONFIGS[arch])
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at ones; randomise them so their weights matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Builds (once per session and arguments) a tiny random model folder."""
    built: dict[tuple[str, int, str | None], Path] = {}

    def make(arch: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
        key = (arch, seed, max_shard_size)
        if key not in built:
            built[key] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed, max_shard_size)
        return built[key]

    return make


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2 folder (converted once; `make test` prepares it beforehand)."""
    from engine.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (text in, text out, fast)."""
    import shutil

    out = tmp_path_factory.mktemp("tiny-chat")
    saved = TINY_CONFIGS["llama"]
    TINY_CONFIGS["tiny-chat"] = dict(saved, vocab_size=49152, max_position_embeddings=512)
    try:
        build_tiny_model("tiny-chat", out, seed=3)
    finally:
        del TINY_CONFIGS["tiny-chat"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, out / name)
    return out
