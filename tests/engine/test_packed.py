"""A float32 CPU model's products on the C kernel over packed weights (engine/layers/packed.py):
what is packed, that the tied table is kept once, and that the engine gives the torch path's
answers, batch-invariant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import kernel_cache_dir
from engine.layers.packed import PackedWeight
from engine.outputs import RequestOutput
from kernels import cpu_native

_CPU = cpu_native.load(kernel_cache_dir())
pytestmark = pytest.mark.skipif(
    _CPU is None or not _CPU.gemm.vectorized or torch.cuda.is_available(),
    reason="the C product builds vectorized on x86 CPUs with AVX2 and FMA",
)


def _logprobs(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.outputs[0].logprobs is not None
    return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.outputs[0].logprobs]


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_projections_and_head_are_packed_and_a_tied_table_is_kept_once(
    tiny_model_factory: Callable[..., Path], arch: str, tied: bool
) -> None:
    llm = LLM(str(tiny_model_factory(arch)), max_model_len=128)
    model = llm.engine.runner.model
    assert model.cfg.tie_word_embeddings is tied
    for layer in model.layers:
        for weight in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert isinstance(weight, PackedWeight)
    assert isinstance(model.head_weight, PackedWeight) and model.lm_head is None
    assert (model.embed_tokens is None) is tied  # tied: the lookups read the head's panels
    matrices = [p for p in model.parameters() if p.dim() == 2]  # beside the panels: the table if untied
    assert len(matrices) == (0 if tied else 1)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_packed_engine_answers_as_the_torch_path_does(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, batch_invariant: bool
) -> None:
    path = str(tiny_model_factory("qwen2"))  # QKV bias, GQA, a tied head
    prompts = [[(i * 37) % 400 + 3 for i in range(70)], [5, 9, 11]]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    got = LLM(path, enable_prefix_caching=False, batch_invariant=batch_invariant).generate(
        prompts, params, use_tqdm=False
    )
    monkeypatch.setattr(cpu_native, "load", lambda *args, **kwargs: None)  # MKL's products
    plain = LLM(path, enable_prefix_caching=False, batch_invariant=batch_invariant)
    assert isinstance(plain.engine.runner.model.layers[0].mlp.down_proj, torch.Tensor)
    want = plain.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(_logprobs(mine), _logprobs(theirs), strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b, strict=True))


def test_batch_invariance_holds_on_the_packed_products(tiny_model_factory: Callable[..., Path]) -> None:
    """A request alone, chunked inside a batch, and from a cached prefix: bit-identical logprobs."""
    path = str(tiny_model_factory("llama"))
    prompt = [(i * 53) % 500 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    first = LLM(path, enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[0]
    chunked = LLM(path, enable_prefix_caching=True, max_num_batched_tokens=37)
    assert isinstance(chunked.engine.runner.model.head_weight, PackedWeight)
    in_batch = chunked.generate([[7] * 40, prompt, [9] * 90], params, use_tqdm=False)[1]
    again = chunked.generate([[9] * 90, prompt], params, use_tqdm=False)[1]
    assert again.num_cached_tokens > 0
    assert _logprobs(in_batch) == _logprobs(again) == _logprobs(first)
