"""Kernel backend selection, and the Triton path end to end against the torch path.

Without CUDA the Triton kernels run through Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): slow, so the models are tiny and the generations short.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, kernel_cache_dir
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from engine.kv_sizing import gpu_kv_budget
from engine.layers.backend import (
    SMALL_BATCH_ROWS,
    TORCH_BACKEND,
    load_backend,
    resolve_backend_name,
    small_batch_linear,
)
from kernels import cpu_native

CUDA = torch.cuda.is_available()


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.skipif(CUDA, reason="the CPU interpreter path; on CUDA the gpu tests cover it")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_backend_gives_the_same_greedy_tokens_as_torch(
    tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    path = str(tiny_model_factory(arch))
    # a shared prefix (prefix-cache hits), prompts longer than the step budget (chunked prefill
    # attending to its own cached chunks), lengths off the block size, decodes mixed with prefills
    shared = list(range(3, 40))
    prompts = [shared + [7, 8, 9], list(range(50, 61)), shared + [11], [5] * 3]
    options = dict(max_model_len=256, block_size=16, max_num_batched_tokens=32, kv_cache_memory=1 << 22)
    expected = _greedy(LLM(path, attention_backend="torch", **options), prompts, 6)
    triton_llm = LLM(path, attention_backend="triton", **options)
    assert triton_llm.engine.runner.backend.name == "triton"
    assert _greedy(triton_llm, prompts, 6) == expected


@pytest.mark.skipif(CUDA, reason="the CPU interpreter path; on CUDA the gpu tests capture real graphs")
def test_decode_graph_buffers_give_the_eager_tokens(tiny_model_factory: Callable[..., Path]) -> None:
    # The graph path's static buffers and padding (slot -1, context 0), replayed eagerly on CPU:
    # 3 sequences run in the size-4 buffers, then fewer as they finish.
    path = str(tiny_model_factory("llama"))
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 9)]
    llm = LLM(
        path,
        attention_backend="triton",
        max_model_len=128,
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    runner = llm.engine.runner
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 6, 4)]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        [1, 2, 4],
        max_blocks_per_seq=128 // runner.block_size,
        num_kv_heads=runner.model_config.num_kv_heads,
        max_model_len=128,
        capture=False,
    )
    replays = 0
    original = runner.graphs.run

    def counting_run(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    runner.graphs.run = counting_run  # type: ignore[method-assign]
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    assert replays >= 5  # every decode step went through the buffers


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_profiling_step_runs_through_the_model(
    tiny_model_factory: Callable[..., Path], backend: str
) -> None:
    if backend == "triton" and CUDA:
        pytest.skip("on CUDA the engine profiles at start-up")
    llm = LLM(
        str(tiny_model_factory("qwen3")),
        attention_backend=backend,
        max_model_len=96,
        max_num_batched_tokens=200,  # two full sequences and a shorter one
        kv_cache_memory=1 << 22,
    )
    runner = llm.engine.runner
    ids, positions, kv, meta = runner.dummy_prefill()
    assert ids.shape[0] == 200 and meta.prefill_context_lens.tolist() == [96, 96, 8]
    with torch.inference_mode():
        hidden = runner.model(ids, positions, kv, meta)
    assert hidden.shape == (200, runner.model_config.hidden_size) and bool(hidden.isfinite().all())
    assert bool(kv[0].k.eq(0).all())  # every slot was padding: nothing stored


def test_backend_auto_picks_triton_on_cuda_and_torch_on_cpu() -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("torch", torch.device("cuda")) == "torch"


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", torch.device("cpu"))


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_decode_graphs_cover_powers_of_two_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(48)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 5, 17, 33, 48)] == [1, 4, 8, 32, 48, 48]
    assert padded_batch_size(sizes, 49) is None


def test_gpu_kv_budget_leaves_room_for_weights_and_activations() -> None:
    gib = 1 << 30
    # 80 GiB device, 0.9 allowed, 2 GiB already used (weights, context), 3 GiB activation peak
    assert gpu_kv_budget(80 * gib, 78 * gib, 0.9, 3 * gib) == int(72 * gib) - 5 * gib
    # another process holding memory shrinks the pool instead of overcommitting
    assert gpu_kv_budget(80 * gib, 40 * gib, 0.9, 3 * gib) == int(72 * gib) - 43 * gib


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_graphs_and_eager_agree(tiny_model_factory: Callable[..., Path], arch: str) -> None:
    path = str(tiny_model_factory(arch))
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 90, 8, 33, 61, 2)]
    # both engines in one process: a fixed KV pool each, not a share of whatever memory is free
    options = dict(max_model_len=512, max_num_seqs=8, kv_cache_memory=1 << 28)
    graphs = LLM(path, **options)
    assert graphs.engine.runner.graphs is not None
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.engine.runner.graphs is None
    # 4 and 8 sequences: captured sizes that eager steps also pad to (rows to multiples of 4), so
    # both paths run the same GEMM shapes and the same attention split count
    for batch in (prompts[:4], prompts):
        assert _greedy(graphs, batch, 24) == _greedy(eager, batch, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_engine_matches_hf_transformers_on_gpu(
    tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
    ours = _greedy(LLM(str(path), dtype="float32", max_model_len=512, kv_cache_memory=1 << 28), prompts, 16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert got == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 11, 12, 64, 65, 300])
def test_the_small_batch_projection_equals_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((rows, 96), (160, 96), (160,)))
    for bias in (None, b):
        got = small_batch_linear(x, w, bias)
        want = torch.nn.functional.linear(x, w, bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if rows > SMALL_BATCH_ROWS:  # a prefill's rows: F.linear itself
            assert torch.equal(got, want)


def test_only_the_torch_backend_without_batch_invariance_takes_the_fast_projection() -> None:
    assert load_backend("torch") is TORCH_BACKEND and TORCH_BACKEND.chunked_logits
    fast = load_backend("torch", batch_invariant=False)
    assert fast.linear is small_batch_linear and not fast.chunked_logits
    assert fast.rms_norm is TORCH_BACKEND.rms_norm  # everything else as the invariant set
    assert not fast.every_row  # without the C kernels
    if _CPU is not None:  # with them: every row to them in both modes, the projections as before
        invariant = load_backend("torch", batch_invariant=True, cpu=_CPU)
        assert invariant.every_row and invariant.cpu_decode is _CPU.decode
        assert invariant.linear is TORCH_BACKEND.linear and invariant.chunked_logits
        fast_c = load_backend("torch", batch_invariant=False, cpu=_CPU)
        assert fast_c.every_row and fast_c.linear is small_batch_linear and not fast_c.chunked_logits


_CPU = cpu_native.load(kernel_cache_dir())


@pytest.mark.skipif(CUDA, reason="CPU projections")
def test_an_engine_without_batch_invariance_projects_the_fast_way(
    tiny_model_factory: Callable[..., Path],
) -> None:
    path = str(tiny_model_factory("qwen2"))  # QKV bias: the fast projection adds it too
    prompts = [list(range(3, 40)), [5] * 3]
    invariant = LLM(path, max_model_len=128)
    fast = LLM(path, max_model_len=128, batch_invariant=False)
    backend = fast.engine.runner.backend
    assert backend.linear is small_batch_linear if _CPU is None else backend.cpu_decode is _CPU.decode
    assert invariant.engine.runner.backend.every_row is (_CPU is not None)
    assert _greedy(fast, prompts, 8) == _greedy(invariant, prompts, 8)
