"""Which device an engine runs on, and what of it the KV pool gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_sizing import KVCompanion, gpu_kv_budget, kv_bytes_per_block, plan_kv_cache
from engine.model_runner import resolve_device
from engine.models.config import ModelConfig
from engine.planner import weight_bytes
from engine.spec_decode.draft_model import DraftProposer


def _config(device: str) -> EngineConfig:
    return EngineConfig.from_kwargs("default", device=device)


def test_a_cuda_device_always_carries_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_device refuses a device without an index ("cuda"): every CUDA engine failed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(_config("auto")) == torch.device("cuda", 3)
    assert resolve_device(_config("cuda")) == torch.device("cuda", 3)
    assert resolve_device(_config("cuda:1")) == torch.device("cuda", 1)
    assert resolve_device(_config("cpu")) == torch.device("cpu")


def test_auto_is_the_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(_config("auto")) == torch.device("cpu")


def test_a_draft_models_weights_and_kv_come_out_of_the_gpu_budget(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft is loaded after the pool is sized from the free memory: room is left for it."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    target = ModelConfig.from_dir(tiny_model_factory("llama"))
    draft_path = str(tiny_model_factory("qwen2"))
    config = EngineConfig.from_kwargs("default", device="cpu", gpu_memory_utilization=0.9)
    companion = DraftProposer.footprint(draft_path, config)
    draft = ModelConfig.from_dir(Path(draft_path))
    assert companion == KVCompanion(
        weight_bytes(draft, "float32", None), kv_bytes_per_block(draft, 1, torch.float32, "auto")
    )

    cuda = torch.device("cuda", 0)
    budget = gpu_kv_budget(80 * gib, 60 * gib, 0.9, gib)
    alone = plan_kv_cache(config, target, torch.float32, cuda, gib)
    shared = plan_kv_cache(config, target, torch.float32, cuda, gib, companion)
    assert alone.num_blocks == budget // alone.bytes_per_block
    assert shared.bytes_per_block == alone.bytes_per_block  # the target's own blocks are unchanged
    draft_block = companion.bytes_per_token * config.block_size
    used = shared.num_blocks * (shared.bytes_per_block + draft_block) + companion.weight_bytes
    assert used <= budget < used + shared.bytes_per_block + draft_block
    fixed = EngineConfig.from_kwargs("default", device="cpu", kv_cache_memory=1 << 24)
    assert plan_kv_cache(fixed, target, torch.float32, cuda, gib, companion).num_blocks == (
        (1 << 24) // alone.bytes_per_block
    )  # an explicit pool size is the pool's alone
