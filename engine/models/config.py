"""ModelConfig: the architecture facts the engine needs, read from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The model folder holds an architecture or option the engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    o_bias: bool = False  # the output projection's bias (Llama, Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate, up and down projections' biases (Llama with mlp_bias)

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra EOS ids) from a model folder."""
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise UnsupportedModelError(f"{path} has no config.json: not an HF model folder")
        raw = json.loads(cfg_path.read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf_dict(raw, gen)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Translate an HF config dict; unsupported architectures raise UnsupportedModelError."""
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        # named heads decide (a Llama classifier is no LM); a causal LM under an older class name
        # (LLaMAForCausalLM) is read by its model_type, as transformers loads it
        if arch is None and (not archs or any(str(a).endswith("ForCausalLM") for a in archs)):
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                raw.get("model_type", "")
            )
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')}: "
                f"supported are {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # Qwen3's config class defaults head_dim to 128, the others' to hidden / heads
        head_dim = int(
            raw.get("head_dim") or (128 if arch == "qwen3" and "head_dim" not in raw else hidden // num_heads)
        )
        # as HF reads them: a (legacy) rope_scaling replaces rope_parameters whole, its theta the
        # config's top-level one or 10000
        legacy = raw.get("rope_scaling")
        rope = dict(legacy or raw.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = legacy or (rope if rope.get("rope_type", "default") != "default" else None)
        partial = next(
            (p for p in ((scaling or {}).get("partial_rotary_factor"), rope.get("partial_rotary_factor"),
                         raw.get("partial_rotary_factor")) if p is not None),
            1.0,
        )  # fmt: skip
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor {partial!r} is not supported (1.0 only)")
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3", "yarn"):
                raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")
            scaling["rope_type"] = kind
            if kind in ("llama3", "yarn"):  # HF's default: the config's own length
                original = (  # outside the dict first: Phi-3's place, which HF reads first
                    raw.get("original_max_position_embeddings")
                    or scaling.get("original_max_position_embeddings")
                    or raw["max_position_embeddings"]
                )
                scaling["original_max_position_embeddings"] = int(original)
            if kind == "yarn" and scaling.get("factor") is None:  # DeepSeek's way: the lengths' ratio
                length = int(raw["max_position_embeddings"])
                scaling["factor"] = length / scaling["original_max_position_embeddings"]
            if kind == "default":
                scaling = None
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # every kernel's MLP is SwiGLU
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (silu only)")
        eos: list[int] = []
        for source in (raw.get("eos_token_id"), (generation or {}).get("eos_token_id")):
            if isinstance(source, int):
                eos.append(source)
            elif isinstance(source, list):
                eos.extend(int(t) for t in source)
        sliding = _sliding_window(arch, raw)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Mistral's projections have no biases whatever its config says (as in HF's model)
            qkv_bias=arch == "qwen2" or (arch in ("llama", "qwen3") and bool(raw.get("attention_bias"))),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            o_bias=arch in ("llama", "qwen3") and bool(raw.get("attention_bias")),
            mlp_bias=arch == "llama" and bool(raw.get("mlp_bias")),
        )


def _sliding_window(arch: str, raw: dict[str, Any]) -> int | None:
    """The attention window as HF's config classes read it (None: none). Mistral's always applies
    (4096 when the key is absent; a `use_sliding_window` key is not Mistral's and HF ignores it);
    Qwen2's and Qwen3's only with `use_sliding_window`, and only if one of the layers slides (those
    from `max_window_layers` on, or `layer_types`). The engine holds a sliding model's context to
    its window, where sliding and full attention are the same."""
    if arch == "llama":
        return None
    window = raw.get("sliding_window", 4096)
    if arch != "mistral":
        if not raw.get("use_sliding_window", False):
            return None
        layers = int(raw["num_hidden_layers"])
        types = raw.get("layer_types")
        if isinstance(types, list):
            slides = "sliding_attention" in types
        else:
            slides = window is not None and int(raw.get("max_window_layers", 28)) < layers
        if not slides:
            return None
    return int(window) if window else None
