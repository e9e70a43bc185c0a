"""Checkpoint loading: missing or mis-shaped tensors are clear errors, never silent broadcasts."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM


def _copy_with(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_reported(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model_factory("qwen2")
    broken = _copy_with(src, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.self_attn\.qkv_bias\[1\]"):
        LLM(str(broken))


def test_mis_shaped_fused_shard_is_reported(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model_factory("llama")

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:1]

    broken = _copy_with(src, tmp_path / "m", shrink)
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape"):
        LLM(str(broken))


def test_unexpected_tensor_is_reported(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model_factory("llama")

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mystery.weight"] = t["model.norm.weight"].clone()

    broken = _copy_with(src, tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mystery\.weight'"):
        LLM(str(broken))
