"""Quantized KV pools in the engine (`kv_cache_dtype` int8 / fp8_e4m3): capacity, batch invariance,
prefix caching, and the Triton path against the torch path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_sizing import plan_kv_cache
from engine.layers import kv_cache
from engine.models.config import ModelConfig
from engine.outputs import RequestOutput

CUDA = torch.cuda.is_available()


def test_the_option_takes_vllm_names_and_refuses_others() -> None:
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(3, 64), (8, 128), (2, 32)])
def test_int8_codes_hold_at_least_1_9_times_the_blocks_of_bfloat16(kv_heads: int, head_dim: int) -> None:
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=kv_heads * head_dim,
        intermediate_size=64,
        num_layers=30,
        num_heads=kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        sliding_window=None,
        eos_token_ids=(0,),
        bos_token_id=None,
        dtype="bfloat16",
    )
    memory = 1 << 28
    cpu = torch.device("cpu")
    blocks = {
        kv: plan_kv_cache(EngineConfig(kv_cache_memory=memory, kv_cache_dtype=kv), model, torch.bfloat16, cpu)
        for kv in ("auto", "int8", "fp8_e4m3")
    }
    ratio = blocks["int8"].num_blocks / blocks["auto"].num_blocks
    assert ratio >= 1.9 if head_dim >= 64 else ratio >= 1.75  # a scale per 32 codes costs more
    assert blocks["fp8_e4m3"].num_blocks == blocks["int8"].num_blocks
    # the bytes per block are what the pools allocate
    pool = kv_cache.allocate(2, 16, kv_heads, head_dim, torch.bfloat16, "int8", cpu)
    assert pool.k_scale is not None and pool.v_scale is not None
    allocated = sum(t.nbytes for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)) // 2
    assert allocated * model.num_layers == blocks["int8"].bytes_per_block


def _logprobs(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.outputs[0].logprobs is not None
    return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.outputs[0].logprobs]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_a_quantized_pool_keeps_batch_invariance_and_stays_close(
    tiny_model_factory: Callable[..., Path], kv: str
) -> None:
    path = str(tiny_model_factory("llama"))
    prompt = [(i * 37) % 500 + 3 for i in range(90)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    alone = LLM(path, enable_prefix_caching=False, kv_cache_dtype=kv, kv_cache_memory=1 << 22)
    runner = alone.engine.runner
    assert runner.kv_caches[0].k.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv]
    assert runner.precision()["kv_cache_dtype"] == kv
    first = alone.generate([prompt], params, use_tqdm=False)[0]
    # chunked inside a batch, and again from the prefix cache: the same bits
    chunked = LLM(path, max_num_batched_tokens=29, kv_cache_dtype=kv, kv_cache_memory=1 << 22)
    in_batch = chunked.generate([[7] * 40, prompt, [9] * 70], params, use_tqdm=False)[1]
    again = chunked.generate([[9] * 70, prompt], params, use_tqdm=False)[1]
    assert again.num_cached_tokens > 0
    assert _logprobs(in_batch) == _logprobs(again) == _logprobs(first)
    # and near the full-precision pool: the first token's top logprobs
    full = LLM(path, enable_prefix_caching=False, kv_cache_memory=1 << 22)
    want = dict(_logprobs(full.generate([prompt], params, use_tqdm=False)[0])[0])
    got = dict(_logprobs(first)[0])
    shared = set(want) & set(got)
    tol = 0.05 if kv == "int8" else 0.2
    assert len(shared) >= 3 and all(abs(want[t] - got[t]) < tol for t in shared)


@pytest.mark.skipif(CUDA, reason="the CPU interpreter path; on CUDA the gpu tests cover it")
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_the_triton_path_reads_and_writes_the_same_codes_as_torch(
    tiny_model_factory: Callable[..., Path], kv: str
) -> None:
    path = str(tiny_model_factory("qwen3"))
    shared = list(range(3, 40))
    prompts = [shared + [7, 8, 9], list(range(50, 61)), shared + [11]]
    options = dict(max_model_len=256, max_num_batched_tokens=32, kv_cache_memory=1 << 22, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    torch_llm = LLM(path, attention_backend="torch", **options)
    triton_llm = LLM(path, attention_backend="triton", **options)
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # the stored codes and scales of the first layer are the same bits
    a, b = torch_llm.engine.runner.kv_caches[0], triton_llm.engine.runner.kv_caches[0]
    assert a.k_scale is not None and b.k_scale is not None
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8)) and torch.equal(a.k_scale, b.k_scale)
