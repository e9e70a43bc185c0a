"""`python -m engine plan`: the seeds' KV formula by hand, the engine's own allocation on the CPU,
the weights a model really holds, tensor-parallel shares, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM
from engine.layers.weight_loading import projection_weights
from engine.models.config import ModelConfig
from engine.planner import GIB, load_model_config, make_plan, weight_bytes

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip


def test_llama3_8b_on_an_h100_matches_the_seeds_formula_by_hand() -> None:
    mc = ModelConfig.from_hf_dict(LLAMA3_8B)
    plan = make_plan("llama3-8b", mc, gpu="H100", context_lens=(8192,))
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 2 x layers x kv_heads x head_dim x bf16
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336  # q, o; k, v; gate, up, down
    params = 32 * (layer + 2 * 4096) + 2 * 128256 * 4096 + 4096
    assert params == 8_030_261_248 and plan.weight_bytes_per_device == 2 * params
    assert plan.num_blocks * plan.block_size * plan.kv_bytes_per_token <= plan.kv_budget_bytes
    assert plan.rows[0].max_concurrent_seqs == plan.num_blocks // (8192 // 16)
    two = make_plan("llama3-8b", mc, gpu="H100", tensor_parallel_size=2, context_lens=(8192,))
    assert two.kv_bytes_per_token == plan.kv_bytes_per_token // 2  # 4 of the 8 KV heads per rank
    assert two.weight_bytes_per_device < 0.51 * plan.weight_bytes_per_device
    assert two.rows[0].max_concurrent_seqs > 2 * plan.rows[0].max_concurrent_seqs


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_cache_dtype": "int8", "block_size": 32},
        {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
        {"quantization": "int4", "block_size": 8},
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_plan_is_what_the_engine_allocates_on_the_cpu(
    tiny_model_factory: Callable[..., Path], arch: str, options: dict[str, Any]
) -> None:
    path = tiny_model_factory(arch)
    memory = 3 << 20
    llm = LLM(str(path), kv_cache_memory=memory, max_model_len=256, **options)
    plan = make_plan(str(path), ModelConfig.from_dir(path), memory_gib=memory / GIB, **options)
    layout = llm.engine.runner.layout
    assert (plan.num_blocks, plan.block_size) == (layout.num_blocks, layout.block_size)
    assert plan.kv_bytes_per_token * plan.block_size == layout.bytes_per_block
    assert plan.num_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_weight_bytes_are_the_models_parameters(
    tiny_model_factory: Callable[..., Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the checkpoint's layout: on the CPU the engine packs the same bytes for its C product
    # (engine/layers/packed.py; plus up to 15 zero rows a matrix), and they stop being parameters
    monkeypatch.setattr("engine.model_runner.use_packed_weights", lambda model, gemm: 0)
    path = tiny_model_factory(arch)
    model = LLM(str(path), max_model_len=64).engine.runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(ModelConfig.from_dir(path), "float32", None) == held


def test_int4_weight_bytes_are_what_the_engine_holds_for_the_default_model() -> None:
    """Its Q4_1 blocks keep float16 scales on the CPU (5/8 of a byte a weight), and its tied head
    becomes an int8 copy beside the float table."""
    model = LLM("default", quantization="int4", max_model_len=64).engine.runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # the table and the norms
    held += sum(p.nbytes for p in projection_weights(model)) + model.head_weight.nbytes
    plan = make_plan("default", load_model_config("default"), quantization="int4", gguf_blocks=True)
    assert plan.weight_bytes_per_device == held
    assert (
        make_plan("default", load_model_config("default"), quantization="int4").weight_bytes_per_device > held
    )


def test_fewer_kv_heads_than_ranks_are_replicated_and_bad_splits_refused(
    tiny_model_factory: Callable[..., Path],
) -> None:
    mc = ModelConfig.from_dir(tiny_model_factory("qwen3"))  # 4 heads, 1 KV head
    one, two = (make_plan("q", mc, memory_gib=0.01, tensor_parallel_size=n) for n in (1, 2))
    assert two.kv_bytes_per_token == one.kv_bytes_per_token  # the KV head is on both ranks
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        make_plan("q", mc, tensor_parallel_size=3)


def test_the_command_prints_a_table_and_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    base = [sys.executable, "-m", "engine", "plan", "--model", str(config), "--gpu", "A100-80G"]
    table = subprocess.run([*base, "--context-len", "4096"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert (
        "KV bytes per token      131,072 per device" in table.stdout
        and "suggested max_num_seqs" in table.stdout
    )
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 131072 and [r["context_len"] for r in data["rows"]] == [
        2048,
        4096,
        8192,
    ]
    bad = subprocess.run([*base, "--tensor-parallel-size", "5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "must divide" in bad.stdout
