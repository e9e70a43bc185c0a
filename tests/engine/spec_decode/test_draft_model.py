"""method draft_model on tiny random models sharing a vocabulary: greedy output equal to plain
decoding's; a draft identical to the target has every draft accepted; the draft's own KV blocks
all come back; incompatible drafts are refused by name."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NOISE = 0.3  # of each weight's spread: the draft then agrees with the target about half the time


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def _draft(path: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "min_acceptance_rate": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def near_copy(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with noise on its weights: a draft that agrees with it often, not always."""
    from safetensors.torch import load_file, save_file

    target = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("near-copy")
    for item in target.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, out / item.name)
    generator = torch.Generator().manual_seed(0)
    weights = load_file(str(target / "model.safetensors"))
    noisy = {
        name: (w + NOISE * w.std() * torch.randn(w.shape, generator=generator)).contiguous()
        for name, w in weights.items()
    }
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_draft_equal_to_the_target_has_every_draft_accepted(
    tiny_model_factory: Callable[..., Path],
) -> None:
    target = tiny_model_factory("llama")
    prompts = _prompts(5)
    expected = _tokens(LLM(str(target), max_model_len=512), prompts)
    spec = LLM(str(target), max_model_len=512, speculative_config=_draft(target))
    assert _tokens(spec, prompts) == expected
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
    draft = spec.engine.speculator.draft  # type: ignore[union-attr]
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 32}, "preempt"],
    ids=["batched", "chunked", "preempted"],
)
def test_a_different_draft_leaves_greedy_output_unchanged(
    tiny_model_factory: Callable[..., Path], near_copy: Path, options: dict[str, Any] | str
) -> None:
    target = tiny_model_factory("llama")
    if options == "preempt":
        cfg = ModelConfig.from_dir(target)
        options = {"kv_cache_memory": 20 * 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4}
    assert isinstance(options, dict)
    prompts = _prompts(8, seed=1)
    expected = _tokens(LLM(str(target), max_model_len=512), prompts)
    spec = LLM(str(target), max_model_len=512, speculative_config=_draft(near_copy), **options)
    assert _tokens(spec, prompts) == expected
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some accepted, some rejected
    if "kv_cache_memory" in options:
        assert spec.engine.stats().num_preemptions > 0
    draft = spec.engine.speculator.draft  # type: ignore[union-attr]
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks  # type: ignore[attr-defined]
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_sampling_with_a_draft_is_reproducible(
    tiny_model_factory: Callable[..., Path], near_copy: Path
) -> None:
    target = tiny_model_factory("llama")
    spec = LLM(str(target), max_model_len=512, speculative_config=_draft(near_copy))
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)
    prompts = _prompts(3, seed=2)
    assert _tokens(spec, prompts, seeded) == _tokens(spec, prompts, seeded)


def test_incompatible_drafts_are_refused_by_name(
    tiny_model_factory: Callable[..., Path], tiny_chat_model: Path, near_copy: Path, tmp_path: Path
) -> None:
    target = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="one model has a tokenizer and the other does not"):
        LLM(str(tiny_chat_model), speculative_config=_draft(target))
    with pytest.raises(ValueError, match="vocabulary"):  # 49,152 tokens drafting for 512
        LLM(str(target), speculative_config=_draft(tiny_chat_model))
    short = tmp_path / "short"
    shutil.copytree(near_copy, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM(str(target), max_model_len=512, speculative_config=_draft(short))
    spec = LLM(str(target), max_model_len=256, speculative_config=_draft(short))  # within its context
    assert len(_tokens(spec, _prompts(1))[0]) == GREEDY.max_tokens


def test_a_draft_sharing_the_targets_tokenizer_is_accepted_and_aborts_give_every_block_back(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(tiny_chat_model, draft)  # same tokenizer files, same weights
    spec = LLM(str(tiny_chat_model), max_model_len=256, speculative_config=_draft(draft))
    engine = spec.engine
    for i in range(3):
        engine.add_request(f"r{i}", "a b c a b c a b", SamplingParams(temperature=0, max_tokens=60))
    for _ in range(6):
        engine.step()
    stats = engine.speculator.stats()  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    for i in range(3):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    pool = engine.speculator.draft.block_manager  # type: ignore[union-attr]
    assert pool.num_free_blocks == pool.num_blocks
