"""EngineConfig: the engine's options, validated once, frozen afterwards."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.spec_decode.config import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# quantization at load time (engine/layers/quant.py): int8 / int4 weights; w8a8: int8 weights
# and int8 activations (one scale per row)
QUANTIZATIONS = ("int8", "int4", "w8a8")
# pre-quantized checkpoints, read from their own layouts (engine/prequantized.py); found from
# config.json when `quantization` is unset
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "fp8", "compressed-tensors")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# KV pool storage (vLLM's names): the model's dtype, or codes with scales (engine/layers/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
_POSITIVE = (
    "max_prompts",
    "max_n",
    "max_choices",
    "max_stop_strings",
    "max_stop_string_len",
    "max_guided_bytes",
    "max_guided_choices",
    "max_guided_regex_len",
    "max_consecutive_step_failures",
)


@dataclass(frozen=True)
class EngineConfig:
    """Engine options, named as in vLLM so its users feel at home."""

    model: str = "default"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    batch_invariant: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False
    quantization: str | None = None  # None: the checkpoint's own; int8/int4/w8a8 at load; awq/gptq/fp8
    kv_cache_dtype: str = "auto"  # "int8" / "fp8_e4m3" ("fp8"): per token-head codes, ~2x the blocks
    # tensor parallelism: the model and every layer's KV pool split over this many ranks, one
    # process each (torch.distributed: gloo on CPU, NCCL on CUDA; engine/parallel/)
    tensor_parallel_size: int = 1
    # seconds a rank waits in a collective before the step fails (a dead or hung rank ends the engine)
    distributed_timeout: float = 60.0
    # speculative decoding: vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}) or
    # its JSON text, checked into a SpeculativeConfig (engine/spec_decode/config.py); None: off
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Per-request caps, checked when a request is admitted (HTTP 400 naming the parameter).
    # They bound the work and memory one request can claim; the defaults allow what OpenAI does
    # for everything except `n` (OpenAI: 128) and `stop` (OpenAI: 4).
    max_prompts: int = 32  # prompts in one /v1/completions `prompt` list
    max_n: int = 16  # completions per prompt (`n`)
    max_choices: int = 128  # prompts x n in one request
    max_stop_strings: int = 16  # entries in `stop`
    max_stop_string_len: int = 256  # characters in one stop string
    max_logprobs: int = 20  # `top_logprobs` (chat) and `logprobs` (completions); OpenAI: 20 and 5
    # Guided decoding: the source of a constraint bounds its compile time and memory (llguidance
    # compiles a 40-object, 9 KB schema in ~25 ms; its own limits refuse grammars that blow up).
    max_guided_bytes: int = 65536  # a JSON schema, grammar or structural tag, as compact UTF-8 JSON/text
    max_guided_choices: int = 256  # entries in a `choice` list
    max_guided_regex_len: int = 4096  # characters in a `regex`
    # Consecutive failed steps after which the engine gives up (the server then exits non-zero).
    max_consecutive_step_failures: int = 3

    def __post_init__(self) -> None:
        known = QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
        if self.quantization is not None and self.quantization not in known:
            raise ValueError(f"quantization must be one of {known} or unset, got {self.quantization!r}")
        kv = _KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", kv)  # one name per format from here on
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")

    @classmethod
    def field_names(cls) -> set[str]:
        """Names accepted as engine options."""
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with a clear message."""
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        if "seed" in kwargs and kwargs["seed"] is None:  # vLLM's LLM(seed=None): its default
            kwargs["seed"] = 0
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        for name, value in kwargs.items():  # (max_model_len="512" was a TypeError naming nothing)
            kwargs[name] = _typed(name, value, types[name])
        return cls(model=model, **kwargs)

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """Options from SWITCHBOARD_ENGINE_* environment variables, then explicit overrides. A variable
        set empty (or blank) counts as unset, as the server's HTTP limits and GATEWAY_* settings do:
        compose's `${VAR:-}` passes one through without the operator meaning a value."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"SWITCHBOARD_ENGINE_{f.name.upper()}")
            if raw is None or not raw.strip():
                continue
            values[f.name] = _parse_env_value(f.name, raw, str(f.type))
        values.update(overrides)
        return cls(**values)


def _typed(name: str, value: Any, type_name: str) -> Any:
    """`value` as its option's plain type (int, float, bool, str; numpy's numbers too, and a whole
    float for an int: kv_cache_memory=16e6), else a TypeError naming the option."""
    kinds = {part.strip() for part in type_name.split("|")} - {"None"}
    if (
        (value is None and "None" in type_name)
        or len(kinds) != 1
        or not kinds <= {"int", "float", "bool", "str"}
    ):
        return value  # (a union of richer types: checked by the config itself)
    kind = kinds.pop()
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "int" and number and float(value).is_integer():
        return int(value)
    if kind == "float" and number:
        return float(value)
    if kind == "bool" and (isinstance(value, bool) or (number and value in (0, 1))):
        return bool(value)
    if kind == "str" and isinstance(value, str):
        return value
    raise TypeError(f"engine option {name} must be {type_name}, got {value!r}")


def _parse_env_value(name: str, raw: str, type_name: str) -> Any:
    if "SpeculativeConfig" in type_name:
        return raw  # JSON text, parsed with the rest of the config's checks
    if "bool" in type_name:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if "int" in type_name:
        try:
            return int(raw)
        except ValueError as exc:
            raise ValueError(f"SWITCHBOARD_ENGINE_{name.upper()} must be an integer, got {raw!r}") from exc
    if "float" in type_name:
        return float(raw)
    return raw


def kernel_cache_dir() -> Path:
    """Where CPU kernels built on this machine live: $SWITCHBOARD_KERNEL_CACHE, else
    ~/.cache/switchboard/kernels (kernels/cpu_native.py)."""
    override = os.environ.get("SWITCHBOARD_KERNEL_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchboard" / "kernels"


def model_cache_dir() -> Path:
    """Where converted models live: $SWITCHBOARD_MODEL_CACHE, else ~/.cache/switchboard/models."""
    override = os.environ.get("SWITCHBOARD_MODEL_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchboard" / "models"
