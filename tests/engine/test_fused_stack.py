"""The decoder stack as one C call (engine/models/fused_stack.py): where the engine binds it, that
the steps go to it, and that it answers bit for bit as the layer-by-layer path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import kernel_cache_dir
from engine.models.fused_stack import FusedStack
from engine.outputs import RequestOutput
from kernels import cpu_native

_CPU = cpu_native.load(kernel_cache_dir())
pytestmark = pytest.mark.skipif(
    _CPU is None or not _CPU.gemm.vectorized or torch.cuda.is_available(),
    reason="the C kernels build vectorized on x86 CPUs with AVX2 and FMA",
)


def _logprobs(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.outputs[0].logprobs is not None
    return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.outputs[0].logprobs]


def _counted(stack: FusedStack) -> list[int]:
    """Counts the rows of the steps the stack runs (wraps its bound call)."""
    rows: list[int] = []
    bound = stack.bound

    def call(h: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(h.shape[0])
        return bound(h, *args)

    stack.bound = call  # type: ignore[assignment]
    return rows


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {}),
        ("qwen2", {"batch_invariant": False}),  # QKV bias, a tied head
        ("llama-biased", {}),  # biases on every projection, YaRN's scaled rotary tables
        ("llama", {"quantization": "int8"}),
        ("llama", {"quantization": "int4", "batch_invariant": False}),
    ],
)
def test_the_stack_answers_as_the_layers_do_bit_for_bit(
    tiny_model_factory: Callable[..., Path], arch: str, options: dict[str, Any]
) -> None:
    path = str(tiny_model_factory(arch))
    # chunked prefills beside decodes (max_num_batched_tokens), prompts off the block size
    prompts = [[(i * 37) % 400 + 3 for i in range(70)], [5, 9, 11], [(i * 11) % 300 + 7 for i in range(23)]]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=4, ignore_eos=True)
    llm = LLM(path, enable_prefix_caching=False, max_num_batched_tokens=32, **options)
    model = llm.engine.runner.model
    assert model.fused is not None
    rows = _counted(model.fused)
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert len(rows) >= 12 and min(rows) <= 3 and max(rows) == 32  # decode steps and prefill chunks
    model.fused = None
    layered = llm.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(fused, layered, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert _logprobs(mine) == _logprobs(theirs)


def test_the_stack_is_bound_only_where_every_kernel_is_c(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LLM(str(tiny_model_factory("llama")), max_model_len=128).engine.runner.model.fused is not None
    # query/key norms (Qwen3) stay with torch's attention; so do int8 caches
    assert LLM(str(tiny_model_factory("qwen3")), max_model_len=128).engine.runner.model.fused is None
    int8_cache = LLM(str(tiny_model_factory("llama")), max_model_len=128, kv_cache_dtype="int8")
    assert int8_cache.engine.runner.model.fused is None
    monkeypatch.setattr(cpu_native, "load", lambda *args, **kwargs: None)  # no C kernels: MKL's products
    assert LLM(str(tiny_model_factory("llama")), max_model_len=128).engine.runner.model.fused is None


def test_a_step_over_other_caches_runs_layer_by_layer(tiny_model_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.model.fused is not None
    rows = _counted(runner.model.fused)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate([[3, 4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert rows  # the steps went to the stack
    runner.kv_caches = list(runner.kv_caches)  # the same tensors in another list: not the bound one
    rows.clear()
    assert llm.generate([[3, 4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert rows == []
