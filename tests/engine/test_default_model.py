"""The bundled default model: converted once into a normal HF folder; model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.default_model import ModelNotFoundError, prepare_default_model, resolve_model
from engine.gguf_blocks import read_blocks
from engine.models.config import ModelConfig


def test_default_model_folder_is_a_complete_hf_folder(default_model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (default_model_dir / name).is_file(), name
    template = default_model_dir / "chat_template.jinja"
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert template.is_file() or "chat_template" in config
    cfg = ModelConfig.from_dir(default_model_dir)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert cfg.tie_word_embeddings


def test_default_model_keeps_its_gguf_q4_1_blocks_for_every_projection(default_model_dir: Path) -> None:
    blocks = read_blocks(default_model_dir, ["model.layers.29.self_attn.k_proj.weight"])
    assert blocks is not None
    k = blocks["model.layers.29.self_attn.k_proj.weight"]
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if n.endswith("_proj.weight")]  # noqa: SIM118
        assert len(names) == 210
        # the rotary rows put back in HF's order: the blocks rebuild the converted weight exactly
        assert torch.equal(k.dequantize(), f.get_tensor("model.layers.29.self_attn.k_proj.weight"))
    assert (every := read_blocks(default_model_dir)) is not None and set(every) == set(names)


def test_second_prepare_is_a_cached_no_op(default_model_dir: Path) -> None:
    before = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_default_model() == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_resolve_accepts_local_folders_and_rejects_hub_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "missing"))
