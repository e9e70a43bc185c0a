"""Config options of the Llama family beyond the base four: biases on every projection, YaRN RoPE,
and the options the kernels cannot compute, refused at load instead of served wrong."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.rotary import attention_factor, compute_inv_freq
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.parallel.sharding import shard_weights
from tests.conftest import TINY_CONFIGS
from tests.hf_compare import compare_greedy, hf_greedy


@pytest.mark.parametrize("arch", ["llama-biased", "qwen3-biased"])
@pytest.mark.parametrize("options", [{}, {"batch_invariant": False, "max_num_batched_tokens": 32}])
def test_biased_and_yarn_models_match_hf_greedy(
    tiny_model_factory: Callable[..., Path], arch: str, options: dict[str, Any]
) -> None:
    path = tiny_model_factory(arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 37, 90)]  # 90 + 20: past YaRN's 64
    ref = hf_greedy(path, prompts, 20)
    llm = LLM(str(path), enable_prefix_caching=False, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    result = compare_greedy([o.token_ids for o in outs], ref)
    assert not result.mismatches, "\n".join(result.mismatches)
    assert result.ties <= 1


def test_the_biases_load_where_hf_has_them() -> None:
    def config(arch: str, **extra: Any) -> ModelConfig:
        raw = {k: v for k, v in TINY_CONFIGS[arch].items()}
        return ModelConfig.from_hf_dict({**raw, **extra})

    llama = config("llama-biased")
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    qwen3 = config("qwen3-biased", mlp_bias=True)  # Qwen3's MLP has no biases in HF
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.mlp_bias) == (True, True, False)
    mistral = config("mistral", attention_bias=True, mlp_bias=True)  # nor do Mistral's projections
    assert (mistral.qkv_bias, mistral.o_bias, mistral.mlp_bias) == (False, False, False)
    qwen2 = config("qwen2", attention_bias=True)  # Q/K/V only, always
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "truncate": False},
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
        },
        {  # DeepSeek's
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64},  # no magnitude change
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_hfs(scaling: dict[str, Any]) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = dict(TINY_CONFIGS["llama"], rope_scaling=scaling, max_position_embeddings=8192)
    raw.pop("model_type")
    mc = ModelConfig.from_hf_dict({**raw, "model_type": "llama"})
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.for_model("llama", **raw), "cpu")
    assert torch.equal(compute_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling), hf_inv_freq)
    assert attention_factor(mc.rope_scaling) == pytest.approx(hf_factor, rel=1e-12)


def test_yarn_without_a_factor_takes_the_lengths_ratio_and_the_original_length_defaults() -> None:
    raw = dict(TINY_CONFIGS["llama"], max_position_embeddings=4096)
    yarn: dict[str, Any] = {"rope_type": "yarn", "original_max_position_embeddings": 1024}
    mc = ModelConfig.from_hf_dict({**raw, "rope_scaling": yarn})
    assert mc.rope_scaling is not None and mc.rope_scaling["factor"] == 4.0
    mc = ModelConfig.from_hf_dict({**raw, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert mc.rope_scaling is not None and mc.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        (
            {
                "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
            },
            "partial_rotary_factor 0.25",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
    ],
)
def test_options_the_kernels_cannot_compute_are_refused_by_name(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf_dict({**TINY_CONFIGS["llama"], **extra})
    assert ModelConfig.from_hf_dict({**TINY_CONFIGS["llama"], "hidden_act": "silu"}).architecture == "llama"


def test_row_parallel_biases_are_rank_zeros_and_column_parallel_ones_are_sliced() -> None:
    mc = ModelConfig.from_hf_dict(dict(TINY_CONFIGS["llama-biased"]))
    inter, hidden = mc.intermediate_size, mc.hidden_size
    weights = [
        ("model.layers.0.self_attn.o_proj.bias", torch.arange(hidden, dtype=torch.float32) + 1),
        ("model.layers.0.mlp.down_proj.bias", torch.arange(hidden, dtype=torch.float32) + 1),
        ("model.layers.0.mlp.gate_proj.bias", torch.arange(inter, dtype=torch.float32)),
    ]
    ranks = [dict(shard_weights(weights, mc, rank, 2)) for rank in range(2)]
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"):
        assert torch.equal(ranks[0][name] + ranks[1][name], weights[0][1])  # summed once over the ranks
        assert not ranks[1][name].any()
    gate = "model.layers.0.mlp.gate_proj.bias"
    assert torch.equal(torch.cat((ranks[0][gate], ranks[1][gate])), weights[2][1])


def _without(arch: str, *keys: str, **extra: Any) -> dict[str, Any]:
    raw = {k: v for k, v in TINY_CONFIGS[arch].items() if k not in keys}
    return {**raw, **extra}


CONFIGS_AS_HF_READS_THEM = [
    # Mistral's window always applies: HF ignores a use_sliding_window key (the engine dropped the
    # window, and its context cap, and answered otherwise from the window's length on)
    _without("mistral", sliding_window=32, use_sliding_window=False),
    _without("mistral", "sliding_window"),  # absent: Mistral's 4096
    _without("mistral", sliding_window=None),
    _without("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1),
    _without("qwen2", use_sliding_window=True, sliding_window=32),  # max_window_layers 28: no layer slides
    _without("qwen2", use_sliding_window=True, sliding_window=32, layer_types=["full_attention"] * 2),
    _without("qwen3", use_sliding_window=True, sliding_window=48, max_window_layers=0),
    _without("qwen3", "head_dim"),  # Qwen3's class defaults it to 128, not hidden / heads
    _without(
        "llama", "rope_theta", "rope_scaling", rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    ),
    # both: HF takes rope_scaling whole, its theta the top-level one or 10000 (the engine took 5e5)
    _without(
        "llama",
        "rope_theta",
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    _without("llama", rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=2e5),
]


@pytest.mark.parametrize("raw", CONFIGS_AS_HF_READS_THEM)
def test_window_head_size_and_rope_are_read_as_hfs_config_classes_read_them(raw: dict[str, Any]) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    ours = ModelConfig.from_hf_dict(raw)
    layer_types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)  # (Llama has none)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    assert ours.sliding_window == (window if slides else None)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    rope = hf.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    kind = rope.get("rope_type", "default")
    assert (ours.rope_scaling or {}).get("rope_type", "default") == kind
    if kind != "default":
        assert ours.rope_scaling is not None and ours.rope_scaling["factor"] == rope["factor"]


def test_a_checkpoint_of_another_head_is_refused_though_its_model_type_is_supported() -> None:
    """A LlamaForSequenceClassification was refused only for its unexpected `score.weight`."""
    raw = dict(TINY_CONFIGS["llama"], architectures=["LlamaForSequenceClassification"])
    with pytest.raises(UnsupportedModelError, match="LlamaForSequenceClassification"):
        ModelConfig.from_hf_dict(raw)
    assert ModelConfig.from_hf_dict(dict(TINY_CONFIGS["llama"], architectures=[])).architecture == "llama"
    old_name = dict(TINY_CONFIGS["llama"], architectures=["LLaMAForCausalLM"])  # early Llama checkpoints
    assert ModelConfig.from_hf_dict(old_name).architecture == "llama"
