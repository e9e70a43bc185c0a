"""Weight-only int8 quantization at load time (`quantization="int8"`, engine/layers/quant.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, kernel_cache_dir
from engine.layers.packed import PackedInt4Weight, PackedInt8Weight, PackedW8A8Weight, PackedWeight
from engine.layers.quant import (
    Int4Weight,
    Int8Weight,
    W8A8Weight,
    quantization_aware,
)
from engine.outputs import RequestOutput
from kernels import cpu_native
from kernels.cpu_gemm import reference_int4_gemm, reference_int8_gemm
from tests.engine.server_proc import ServerProcess

_CPU = cpu_native.load(kernel_cache_dir())
# where the C product builds, the engine moves every int8 weight to it (engine/layers/packed.py)
INT8_KIND = PackedInt8Weight if _CPU is not None and _CPU.gemm.vectorized else Int8Weight
W8A8_KIND = PackedW8A8Weight if _CPU is not None and _CPU.gemm.vectorized else W8A8Weight
INT4_KIND = PackedInt4Weight if _CPU is not None and _CPU.gemm.vectorized else Int4Weight


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w[0] = 0.0  # an all-zero row: a tiny scale, no division by zero
    w[1, 3] = 40.0  # an outlier sets its row's scale
    return w


def test_quantized_values_are_within_half_a_step_of_the_weights() -> None:
    w = _weight(64, 96, 0)
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == torch.bfloat16 and q.shape == w.shape
    assert int(q.qweight.abs().max()) <= 127
    scales = q.scales.float()
    assert torch.all(scales * 127 >= w.abs().amax(dim=1))  # the stored (bf16) scale covers the row
    error = (q.dequantize() - w).abs()
    assert torch.all(error <= scales[:, None] / 2 + 1e-6)
    assert torch.equal(q.dequantize()[0], torch.zeros(96))
    assert q.nbytes == 64 * 96 + 2 * 64


@pytest.mark.parametrize("rows", [1, 4, 13, 200])
def test_the_int8_product_matches_the_dequantized_weight_on_bfloat16_activations(rows: int) -> None:
    w, bias = _weight(80, 96, 1), torch.randn(80)
    q = Int8Weight.quantize(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = q.matmul(x, bias)
    want = torch.nn.functional.linear(x.to(torch.bfloat16).float(), q.dequantize(), bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)  # the product comes back in bfloat16
    project = quantization_aware(torch.nn.functional.linear)
    assert torch.equal(project(x, q, bias), got) and torch.equal(project(x, w, None), x @ w.T)


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_w8a8_product_is_the_integer_product_of_both_rounded_operands(rows: int) -> None:
    w, bias = _weight(80, 96, 5), torch.randn(80)
    q = W8A8Weight.quantize(w)
    assert q.qweight.shape == (96, 80) and q.shape == (80, 96) and q.nbytes == 96 * 80 + 4 * 80
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    x[0, 7] = 30.0  # an outlier sets its row's scale, not the other rows'
    row_scale = x.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(x / row_scale)
    want = (codes @ q.qweight.float()) * row_scale * q.scales + bias  # exact integer products
    torch.testing.assert_close(q.matmul(x, bias), want, rtol=1e-5, atol=1e-5)
    # and near the float product for weights and activations without outliers
    gen = torch.Generator().manual_seed(9)
    plain, y = torch.randn(80, 96, generator=gen) * 0.1, torch.randn(rows, 96, generator=gen)
    torch.testing.assert_close(W8A8Weight.quantize(plain).matmul(y), y @ plain.T, rtol=0, atol=0.05)


def test_int4_values_are_within_half_a_step_of_their_group() -> None:
    w = _weight(64, 96, 3)
    q = Int4Weight.quantize(w)
    assert q.group_size == 32 and q.shape == w.shape and q.nbytes == 64 * 48 + 2 * 3 * 64 * 2
    steps = q.scales_and_zeros[..., 0].float().t()  # (out, groups)
    bound = steps.repeat_interleave(32, dim=1) / 2
    # dequantize() runs through the kernel, whose output is bfloat16: add that rounding
    assert torch.all((q.dequantize() - w).abs() <= bound + w.abs() / 128 + 1e-3)
    fourbit = torch.randint(0, 16, (64, 96)).float() * 0.25 - 1.0  # already on a 4-bit grid,
    fourbit[:, ::32], fourbit[:, 1::32] = -1.0, 2.75  # each group spanning it (as a GGUF's blocks)
    torch.testing.assert_close(Int4Weight.quantize(fourbit).dequantize(), fourbit)
    with pytest.raises(ValueError, match="groups of 32"):
        Int4Weight.quantize(torch.randn(8, 40))


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight, W8A8Weight])
def test_a_rows_quantized_product_does_not_depend_on_the_other_rows(kind: type) -> None:
    q = kind.quantize(_weight(160, 96, 4))
    row = torch.randn(1, 96)
    alone = q.matmul(row)[0]
    for rows, at in ((4, 0), (4, 3), (17, 9), (64, 63), (300, 150)):
        batch = torch.randn(rows, 96)
        batch[at] = row[0]
        assert torch.equal(q.matmul(batch)[at], alone)


def test_an_unknown_quantization_and_w8a8_off_the_cpu_path_are_refused(
    tiny_model_factory: Callable[..., Path],
) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    if not torch.cuda.is_available():  # the Triton backend runs here through the interpreter
        with pytest.raises(ValueError, match="'w8a8' runs on the CPU path"):
            LLM(str(tiny_model_factory("llama")), attention_backend="triton", quantization="w8a8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_model_decodes_through_cuda_graphs(
    tiny_model_factory: Callable[..., Path], quantization: str
) -> None:
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = [[(i * 7 + j) % 500 + 3 for i in range(30 + j)] for j in range(3)]
    memory = {"kv_cache_memory": 1 << 28}  # two engines on one GPU: not 90% of it each
    graphed = LLM(path, quantization=quantization, max_model_len=256, max_num_seqs=4, **memory)
    assert graphed.engine.runner.graphs is not None
    eager = LLM(
        path, quantization=quantization, max_model_len=256, max_num_seqs=4, enforce_eager=True, **memory
    )
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


def _logprobs(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.outputs[0].logprobs is not None
    return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.outputs[0].logprobs]


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_a_quantized_engine_keeps_batch_invariance_and_close_logprobs(
    tiny_model_factory: Callable[..., Path], quantization: str
) -> None:
    path = str(tiny_model_factory("qwen2"))  # QKV bias, untied LM head
    prompt = [(i * 53) % 500 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    full = LLM(path, enable_prefix_caching=False)
    reference = full.generate([prompt], params, use_tqdm=False)[0]
    alone = LLM(path, enable_prefix_caching=False, quantization=quantization)
    runner = alone.engine.runner
    assert runner.precision() == {
        "dtype": "float32",
        "quantization": quantization,
        "kv_cache_dtype": "float32",
        "batch_invariant": True,
    }
    kind = {"int8": INT8_KIND, "int4": INT4_KIND, "w8a8": W8A8_KIND}[quantization]
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj, kind)
    assert isinstance(runner.model.layers[0].mlp.down_proj, INT8_KIND if quantization == "w8a8" else kind)
    assert runner.model.lm_head is None and runner.model.head_weight is not None
    first = alone.generate([prompt], params, use_tqdm=False)[0]
    # the same request chunked inside a batch, and from a cached prefix: bit-identical logprobs
    chunked = LLM(path, enable_prefix_caching=True, max_num_batched_tokens=37, quantization=quantization)
    in_batch = chunked.generate([[7] * 40, prompt, [9] * 90], params, use_tqdm=False)[1]
    again = chunked.generate([[9] * 90, prompt], params, use_tqdm=False)[1]
    assert again.num_cached_tokens > 0
    assert _logprobs(in_batch) == _logprobs(again) == _logprobs(first)
    if quantization == "int8":  # close to full precision: the first token's top logprobs within 0.1
        # (a random model of width 64 feels each rounding more than a trained one, and 4-bit steps
        # far more: docs/quantization.md has the default model's figures)
        want, got = dict(_logprobs(reference)[0]), dict(_logprobs(first)[0])
        shared = set(want) & set(got)
        assert len(shared) >= 3 and all(abs(want[t] - got[t]) < 0.1 for t in shared)


def test_the_server_says_what_precision_it_serves(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    proc = ServerProcess(model, "--quantization", "int8", "--kv-cache-dtype", "fp8", "--no-access-log")
    try:
        card = httpx.get(f"{proc.base_url}/v1/models", timeout=10).json()["data"][0]
        assert card["precision"] == {
            "dtype": "float32",
            "quantization": "int8",
            "kv_cache_dtype": "fp8_e4m3",
            "batch_invariant": True,
        }
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert "quantization int8" in proc.output() and "kv_cache_dtype fp8_e4m3" in proc.output()
    finally:
        assert proc.stop() == 0


def float_twin_logprobs(quantized: LLM, path: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs (whole vocabulary) of a quantized engine, and of a float engine whose
    weights are the quantized ones dequantized: they differ only by the kernels' arithmetic."""
    from engine.evaluate import prefill_logprobs

    twin = LLM(path, enable_prefix_caching=False, max_model_len=128)
    ours, theirs = quantized.engine.runner.model, twin.engine.runner.model
    with torch.no_grad():
        for prefix, module in ours.named_modules():
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                weight = getattr(module, name, None)
                if weight is not None and not isinstance(weight, torch.Tensor):
                    _set_float_weight(theirs.get_submodule(prefix), name, weight.dequantize())
        if ours.head_weight is not None and not ours.cfg.tie_word_embeddings:
            _set_float_weight(theirs, "lm_head" if theirs.lm_head is not None else "head_weight",
                              ours.head_weight.dequantize())  # fmt: skip
        theirs.fused = None  # bound to the weights replaced here: the twin runs layer by layer
    return prefill_logprobs(quantized, tokens), prefill_logprobs(twin, tokens)


def _set_float_weight(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """A float engine's weight set to `value`, in the form it holds it (packed for the C kernel or not)."""
    current = getattr(module, name)
    if isinstance(current, PackedWeight):
        setattr(module, name, PackedWeight.pack(value, current.gemm))
    else:
        current.copy_(value)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter path; on CUDA the gpu tests cover it"
)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_triton_backend_quantizes_at_load_for_its_own_kernels(
    tiny_model_factory: Callable[..., Path], quantization: str
) -> None:
    from engine.evaluate import prefill_logprobs
    from engine.layers.quant_triton import TritonInt4Weight, TritonInt8Weight

    path = str(tiny_model_factory("llama"))
    llm = LLM(path, attention_backend="triton", quantization=quantization, max_model_len=128)
    runner = llm.engine.runner
    kind = TritonInt8Weight if quantization == "int8" else TritonInt4Weight
    assert isinstance(runner.model.layers[1].mlp.gate_up_proj, kind)
    assert isinstance(runner.model.head_weight, TritonInt8Weight)
    weight = runner.model.layers[1].mlp.gate_up_proj
    assert weight.nbytes < 0.35 * weight.shape[0] * weight.shape[1] * 4  # well under float32's bytes
    # the kernels compute what the dequantized weights do (float32 activations: to rounding)
    tokens = [(i * 17) % 500 + 3 for i in range(24)]
    ours, twin = float_twin_logprobs(llm, path, tokens)
    torch.testing.assert_close(ours, twin, atol=2e-4, rtol=0)
    full = LLM(path, enable_prefix_caching=False, max_model_len=128)
    drift = float((prefill_logprobs(full, tokens) - ours).abs().mean())
    # and near full precision (a random model of width 64 feels 4-bit steps far more than a trained one)
    assert drift < (0.05 if quantization == "int8" else 0.5)


def test_smoothing_moves_outliers_into_the_weights_without_changing_the_model(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.evaluate import prefill_logprobs
    from engine.layers.smoothing import input_maxima, smooth

    # smoothing runs while w8a8 loads, on the float weights: none packed for the C kernel here
    monkeypatch.setattr("engine.model_runner.use_packed_weights", lambda model, gemm: 0)
    llm = LLM(str(tiny_model_factory("llama")), enable_prefix_caching=False, max_model_len=128)
    runner = llm.engine.runner
    model = runner.model
    tokens = [(i * 19) % 500 + 3 for i in range(40)]
    before = prefill_logprobs(llm, tokens)
    linears = [layer.mlp.linear for layer in model.layers]
    maxima = input_maxima(model, lambda t: runner._prefill_alone(model, t))
    assert [layer.mlp.linear for layer in model.layers] == linears  # the recorders are gone
    qkv = model.layers[0].self_attn.qkv_proj
    assert maxima[id(qkv)].shape == (qkv.shape[1],) and bool((maxima[id(qkv)] > 0).all())
    spread = float(maxima[id(qkv)].max() / maxima[id(qkv)].median())
    assert smooth(model, maxima) == 2 * len(model.layers)
    after_act = input_maxima(model, lambda t: runner._prefill_alone(model, t))[id(qkv)]
    assert float(after_act.max() / after_act.median()) < spread  # the inputs' outliers are flatter
    torch.testing.assert_close(prefill_logprobs(llm, tokens), before, atol=1e-4, rtol=0)  # same model


@pytest.mark.skipif(_CPU is None, reason="no C compiler here")
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_packed_int8_product_is_its_reference_and_closer_than_bfloat16_activations(rows: int) -> None:
    assert _CPU is not None
    gen = torch.Generator().manual_seed(rows)
    weight, x, bias = (
        torch.randn(99, 80, generator=gen),  # 99: a partial last panel
        torch.randn(rows, 80, generator=gen),
        torch.randn(99),
    )
    plain = Int8Weight.quantize(weight)
    packed = PackedInt8Weight.of(plain, _CPU.gemm)
    assert packed.shape == plain.shape and torch.equal(packed.dequantize(), plain.dequantize())
    assert torch.equal(packed.codes(), plain.qweight)
    got = packed.matmul(x, bias)
    assert torch.equal(got, reference_int8_gemm(x, plain.qweight, plain.scales.float()) + bias)
    # int16 activations: within 1e-4 of the float32 product, and nearer it than torch's int8
    # kernel (bfloat16 activations) by an order of magnitude
    exact = x.double() @ plain.dequantize().double().T + bias
    error = (got.double() - exact).norm() / exact.norm()
    assert error < 1e-4
    assert error * 10 < (plain.matmul(x, bias).double() - exact).norm() / exact.norm()
    alone = torch.cat([packed.matmul(x[i : i + 1], bias) for i in range(rows)])
    assert torch.equal(alone, got)  # each row on its own: batch-invariant


@pytest.mark.skipif(_CPU is None, reason="no C compiler here")
def test_int8_weights_run_on_the_packed_kernel_and_the_decode_block_fuses_without_invariance(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Every int8 weight packed (head included) in both modes; without batch invariance the attention
    block is fused for decode rows, with it for every row (the prefill's too); greedy tokens and
    logprobs alike in both."""
    path = str(tiny_model_factory("llama"))
    prompt = [(i * 37) % 400 + 3 for i in range(60)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    fast = LLM(path, enable_prefix_caching=False, quantization="int8", batch_invariant=False)
    model = fast.engine.runner.model
    assert isinstance(model.head_weight, PackedInt8Weight)
    assert all(isinstance(layer.mlp.down_proj, PackedInt8Weight) for layer in model.layers)
    model.fused = None  # the layer-by-layer path (the stack in one call: tests/engine/test_fused_stack.py)
    fused = []
    attention = model.layers[0].self_attn
    _spy(attention, fused)
    got = fast.generate([prompt], params, use_tqdm=False)[0]
    assert fused == [60] + [1] * 11  # the prompt's rows and every decode row, in this mode too
    invariant = LLM(path, enable_prefix_caching=False, quantization="int8")
    model = invariant.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedInt8Weight)
    assert invariant.engine.runner.backend.every_row
    model.fused = None
    every: list[int] = []
    attention = model.layers[0].self_attn
    _spy(attention, every)
    want = invariant.generate([prompt], params, use_tqdm=False)[0]
    assert every == [60] + [1] * 11  # the prompt's rows and every decode row
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(_logprobs(got), _logprobs(want), strict=True):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        # the same int8 products and decode attention; the prefill's attention differs in its order
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(mine, theirs, strict=True))


def _spy(attention: Any, calls: list[int]) -> None:
    """Note the rows of each call the layer makes to the C attention block, and pass it on."""
    bind = attention._bound_attention

    def bound(kv_cache: Any) -> Callable[..., torch.Tensor]:
        real = bind(kv_cache)

        def call(qkv: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
            calls.append(qkv.shape[0])
            return real(qkv, *args)

        return call

    attention._bound_attention = bound


@pytest.mark.skipif(_CPU is None, reason="no C compiler here")
def test_the_c_decode_path_gives_the_torch_paths_tokens_and_logprobs_in_float32(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_model_factory("qwen2"))  # QKV bias, GQA
    prompts = [[(i * 37) % 400 + 3 for i in range(60)], [5, 9, 11]]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    fast = LLM(path, enable_prefix_caching=False, batch_invariant=False)
    assert fast.engine.runner.backend.cpu_decode is not None
    got = fast.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(cpu_native, "load", lambda *args, **kwargs: None)
    plain = LLM(path, enable_prefix_caching=False, batch_invariant=False)
    assert plain.engine.runner.backend.cpu_decode is None
    want = plain.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(_logprobs(mine), _logprobs(theirs), strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b, strict=True))


@pytest.mark.skipif(_CPU is None or not _CPU.gemm.vectorized, reason="the C product builds vectorized on x86")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_the_packed_w8a8_product_gives_torch_int_mms_bits_at_every_row_count(rows: int) -> None:
    """With VNNI, C's dpbusd up to 16 rows and torch._int_mm past them; without, C's int16 lanes at
    every row count (torch._int_mm is oneDNN's slow reference loop there): the same exact sums, the
    same bits."""
    assert _CPU is not None
    gen = torch.Generator().manual_seed(rows)
    weight, x, bias = (
        torch.randn(99, 70, generator=gen),
        torch.randn(rows, 70, generator=gen),
        torch.randn(99),
    )
    plain = W8A8Weight.quantize(weight)
    packed = PackedW8A8Weight.of(plain, _CPU.gemm)
    assert packed.row_limit == (PackedW8A8Weight.FEW_ROWS if _CPU.gemm.vnni else None)
    assert packed.shape == plain.shape and torch.equal(packed.dequantize(), plain.dequantize())
    got = packed.matmul(x, bias)
    assert got.shape == (rows, 99)
    assert torch.equal(got, plain.matmul(x, bias))


@pytest.mark.skipif(_CPU is None or not _CPU.gemm.vectorized, reason="the C product builds vectorized on x86")
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_packed_int4_product_is_its_reference_and_a_4_bit_grid_keeps_its_values(rows: int) -> None:
    """Float32 scales and offsets: a weight already on a 4-bit grid per group of 32 (as the default
    model's Q4_1 blocks) comes back to float32's rounding, which torch's int4 kernel (bfloat16
    scales) does not give; the product is reference_int4_gemm's bits, each row on its own."""
    assert _CPU is not None
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (99, 96), generator=gen)  # 99 outputs: a partial last panel
    q[:, ::32], q[:, 1::32] = 0, 15  # each group spans the grid, as GGUF's Q4_1 blocks do
    d = torch.rand(99, 3, generator=gen).repeat_interleave(32, dim=1) * 0.02 + 1e-3
    m = torch.randn(99, 3, generator=gen).repeat_interleave(32, dim=1) * 0.1
    weight = q.float() * d + m  # a Q4_1 model expanded to float32
    packed = PackedInt4Weight.quantize(weight, _CPU.gemm)
    assert packed.shape == weight.shape and packed.nbytes == 7 * 3 * (8 * 32 + 128)
    assert torch.equal(_CPU.gemm.unpack_int4(packed.packed, 99, 32)[0], q.to(torch.uint8))
    torch.testing.assert_close(packed.dequantize(), weight, rtol=0, atol=2e-7)
    assert float((Int4Weight.quantize(weight[:96]).dequantize() - weight[:96]).abs().max()) > 1e-4  # bf16
    x, bias = torch.randn(rows, 96, generator=gen), torch.randn(99, generator=gen)
    got = packed.matmul(x, bias)
    values, scales, offsets = _CPU.gemm.unpack_int4(packed.packed, 99, 32)
    assert torch.equal(got, reference_int4_gemm(x, values, scales, offsets, 32) + bias)
    exact = x.double() @ weight.double().T + bias
    assert (got.double() - exact).norm() / exact.norm() < 1e-4
    assert torch.equal(torch.cat([packed.matmul(x[i : i + 1], bias) for i in range(rows)]), got)
    assert packed.matmul(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.skipif(
    _CPU is None or not _CPU.gemm.vectorized or not _CPU.gemm.half_scales,
    reason="needs the C product with F16C",
)
def test_a_model_expanded_from_q4_1_blocks_gets_its_own_blocks_back_bit_for_bit() -> None:
    """GGUF Q4_1's float16 scales and offsets, expanded to float32 as GGUF's dequantization does
    (q * d + m): int4 finds the same blocks and stores them as float16 (5 bits a weight, Q4_1's
    size), every weight exactly the checkpoint's; a weight off every float16 grid keeps float32."""
    assert _CPU is not None
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (40, 128), generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15
    d = (torch.rand(40, 4, generator=gen) * 0.02 + 1e-3).half().float()
    m = (torch.randn(40, 4, generator=gen) * 0.1).half().float()
    weight = q.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    packed = PackedInt4Weight.quantize(weight, _CPU.gemm)
    assert packed.nbytes == 3 * 4 * (8 * 32 + 64)  # 16 halves of d and 16 of m a panel and group
    assert torch.equal(packed.dequantize(), weight)
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(packed.matmul(x), reference_int4_gemm(x, q, d, m, 32))
    nudged = weight.clone()
    nudged[0, 1] = torch.nextafter(nudged[0, 1], torch.tensor(1.0))  # a group's top off its grid
    assert PackedInt4Weight.quantize(nudged, _CPU.gemm).nbytes == 3 * 4 * (8 * 32 + 128)


@pytest.mark.skipif(_CPU is None or not _CPU.gemm.vectorized, reason="the C product builds vectorized on x86")
def test_an_act_order_grid_on_the_packed_int4_product_reads_its_inputs_in_group_order() -> None:
    assert _CPU is not None
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (20, 64), generator=gen)
    zeros, scales = torch.randint(0, 16, (20, 2), generator=gen), torch.rand(20, 2, generator=gen) * 0.05
    g_idx = torch.randperm(64, generator=gen) % 2  # each input's group, shuffled (GPTQ act-order)
    packed = PackedInt4Weight.from_grid(q, zeros, scales, g_idx, 32, _CPU.gemm)
    assert packed.input_perm is not None
    want = (q.float() - zeros.float()[:, g_idx]) * scales[:, g_idx]  # the checkpoint's weight
    torch.testing.assert_close(packed.dequantize(), want, rtol=0, atol=1e-6)
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(packed.matmul(x), x @ want.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="groups"):
        PackedInt4Weight.quantize(torch.randn(8, 40), _CPU.gemm)


@pytest.mark.skipif(_CPU is None or not _CPU.gemm.vectorized, reason="the C product builds vectorized on x86")
def test_an_int4_engine_computes_its_own_rows_only_in_both_modes(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Every product on the C kernel (int4 projections, int8 head): a batch-invariant step is not
    padded to MKL's row multiple; a prequantized model whose head stays float still is."""
    path = str(tiny_model_factory("llama"))
    for invariant in (True, False):
        runner = LLM(path, quantization="int4", batch_invariant=invariant).engine.runner
        assert isinstance(runner.model.head_weight, PackedInt8Weight) and not runner._pad_rows
    assert LLM(path).engine.runner._pad_rows is False  # float32, packed
    # with VNNI, torch._int_mm past 16 rows; without, the C kernel at every row count
    assert LLM(path, quantization="w8a8").engine.runner._pad_rows is _CPU.gemm.vnni
