"""A GGUF's Q4_1 projection blocks: read from the GGUF, kept beside the float weights, served as int4."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file, save_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from engine import LLM, SamplingParams
from engine.config import kernel_cache_dir
from engine.gguf_blocks import (
    BLOCKS_FILE,
    BlocksFormatError,
    Q4Blocks,
    blocks_from_gguf,
    gguf_projection_blocks,
    read_blocks,
    write_blocks,
)
from engine.layers.packed import PackedInt4Weight
from engine.weights import iter_weights
from kernels import cpu_native

Q4_1 = GGMLQuantizationType.Q4_1
HEADS, KV_HEADS = 4, 2
_CPU = cpu_native.load(kernel_cache_dir())
needs_c_product = pytest.mark.skipif(
    _CPU is None or not _CPU.gemm.vectorized or torch.cuda.is_available(),
    reason="int4 from blocks is the C product's (x86 CPUs with AVX2 and FMA)",
)


def _permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's rotary reordering of q's and k's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path) -> dict[str, np.ndarray]:
    """A two-layer llama GGUF as llama.cpp writes one: Q4_1 projections (q and k permuted), a Q8_0
    table, F32 norms, and one layer's down projection in Q8_0 (not Q4_1: left out). Returns the
    GGUF tensors' float values by name."""
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64)}
    shapes |= {"ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
    writer = GGUFWriter(str(path), "llama")
    values: dict[str, np.ndarray] = {}
    for layer in range(2):
        for key, shape in shapes.items():
            name = f"blk.{layer}.{key}.weight"
            w = rng.standard_normal(shape).astype(np.float32)
            if key in ("attn_q", "attn_k"):
                w = _permute_like_llama_cpp(w, HEADS if key == "attn_q" else KV_HEADS)
            kind = GGMLQuantizationType.Q8_0 if (layer, key) == (1, "ffn_down") else Q4_1
            raw = quants.quantize(w, kind)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
            values[name] = quants.dequantize(raw, kind)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(64, dtype=np.float32))
    table = quants.quantize(rng.standard_normal((512, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", table, raw_shape=table.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_gguf_blocks_give_the_weights_transformers_reads_from_the_gguf(tmp_path: Path) -> None:
    values = _write_gguf(tmp_path / "m.gguf")
    blocks = gguf_projection_blocks(tmp_path / "m.gguf", HEADS, KV_HEADS)

    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    hf |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    hf |= {"ffn_down": "mlp.down_proj"}
    expected = {
        f"model.layers.{name.split('.')[1]}.{hf[name.split('.')[2]]}.weight": processor.process(
            value, name
        ).weights
        for name, value in values.items()
        if name != "blk.1.ffn_down.weight"  # Q8_0: not read as blocks
    }
    assert set(blocks) == set(expected)
    for name, b in blocks.items():
        assert b.q.dtype == torch.uint8 and int(b.q.max()) <= 15
        assert torch.equal(b.dequantize(), torch.from_numpy(np.ascontiguousarray(expected[name]))), name


def test_blocks_of_a_wrong_byte_count_are_refused() -> None:
    with pytest.raises(BlocksFormatError):
        blocks_from_gguf(np.zeros((4, 39), dtype=np.uint8), 4, 64)
    with pytest.raises(BlocksFormatError):
        blocks_from_gguf(np.zeros((4, 20), dtype=np.uint8), 4, 48)  # not whole blocks


def _random_blocks(rows: int, cols: int, seed: int) -> Q4Blocks:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return blocks_from_gguf(quants.quantize(w, Q4_1), rows, cols)


def test_stored_blocks_read_back_exactly_and_by_name(tmp_path: Path) -> None:
    blocks = {"a.weight": _random_blocks(16, 64, 1), "b.weight": _random_blocks(8, 96, 2)}
    assert read_blocks(tmp_path) is None
    write_blocks(tmp_path, blocks)
    back = read_blocks(tmp_path)
    assert back is not None and set(back) == set(blocks)
    for name, b in blocks.items():
        for field in ("q", "d", "m"):
            assert torch.equal(getattr(back[name], field), getattr(b, field))
    only = read_blocks(tmp_path, ["b.weight"])
    assert only is not None and set(only) == {"b.weight"}
    assert read_blocks(tmp_path, ["a.weight", "c.weight"]) is None  # one missing: none


def test_a_foreign_blocks_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / BLOCKS_FILE).parent.mkdir()
    save_file(
        {"x.q": torch.zeros(2, 2, dtype=torch.uint8)}, str(tmp_path / BLOCKS_FILE), metadata={"format": "x"}
    )
    with pytest.raises(BlocksFormatError):
        read_blocks(tmp_path)


def test_iter_weights_never_reads_skipped_tensors(tiny_model_factory: Callable[..., Path]) -> None:
    folder = tiny_model_factory("llama")
    every = {name for name, _ in iter_weights(folder, torch.float32)}
    skip = {name for name in every if name.endswith("_proj.weight")}
    assert skip and {name for name, _ in iter_weights(folder, torch.float32, skip=skip)} == every - skip


def _q4_1_model(source: Path, out: Path) -> dict[str, Q4Blocks]:
    """A copy of a tiny model whose projections are Q4_1 values, with their blocks stored beside."""
    shutil.copytree(source, out)
    state = load_file(str(out / "model.safetensors"))
    blocks: dict[str, Q4Blocks] = {}
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            rows, cols = w.shape
            blocks[name] = blocks_from_gguf(quants.quantize(w.numpy(), Q4_1), rows, cols)
            state[name] = blocks[name].dequantize()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_blocks(out, blocks)
    return blocks


def _int4_projections(llm: LLM) -> dict[str, PackedInt4Weight]:
    model = llm.engine.runner.model
    found = {}
    for prefix, module in model.named_modules():
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = getattr(module, name, None)
            if weight is not None:
                assert isinstance(weight, PackedInt4Weight)
                found[f"{prefix}.{name}"] = weight
    return found


@needs_c_product
def test_int4_from_blocks_is_int4_found_at_load_and_reads_no_projection_floats(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tiny_model_factory("llama")
    _q4_1_model(source, tmp_path / "plain")
    shutil.rmtree(tmp_path / "plain" / BLOCKS_FILE.parent)  # quantized at load, blocks found again
    _q4_1_model(source, tmp_path / "blocks")
    # the blocks model's float projections spoiled: from its blocks, they are never read
    state = load_file(str(tmp_path / "blocks" / "model.safetensors"))
    spoiled = {
        k: torch.full_like(v, float("nan")) if k.endswith("_proj.weight") else v for k, v in state.items()
    }
    save_file(spoiled, str(tmp_path / "blocks" / "model.safetensors"), metadata={"format": "pt"})

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 11, 200, 17], [3, 4]]
    plain = LLM(str(tmp_path / "plain"), quantization="int4", max_model_len=128)
    with caplog.at_level("INFO", logger="engine.layers.weight_loading"):
        from_blocks = LLM(str(tmp_path / "blocks"), quantization="int4", max_model_len=128)
    assert "the GGUF's Q4_1 blocks" in caplog.text

    a, b = _int4_projections(plain), _int4_projections(from_blocks)
    assert len(a) == 8 and set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].packed, b[name].packed), name
    want = plain.generate(prompts, params, use_tqdm=False)
    got = from_blocks.generate(prompts, params, use_tqdm=False)
    for x, y in zip(want, got, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs


@needs_c_product
def test_blocks_that_miss_a_projection_are_not_used(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocks = _q4_1_model(tiny_model_factory("llama"), tmp_path / "m")
    del blocks["model.layers.1.mlp.up_proj.weight"]
    write_blocks(tmp_path / "m", blocks)
    with caplog.at_level("INFO", logger="engine.layers.weight_loading"):
        llm = LLM(str(tmp_path / "m"), quantization="int4", max_model_len=128)
    assert "weights: int4," in caplog.text and "Q4_1 blocks" not in caplog.text
    assert len(_int4_projections(llm)) == 8
