"""Pre-quantized checkpoints (engine/prequantized.py): synthetic AWQ, GPTQ and FP8 checkpoints written
here in the published packing layouts, read back exactly and served by the CPU kernels."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.packed import PackedInt4Weight, PackedInt8Weight
from engine.layers.quant import Int4Weight, Int8Weight
from engine.prequantized import CheckpointFormatError, iter_prequantized, read_checkpoint_quant

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i holds column order[i]
# per-channel int8 as loaded, or moved to the C product after loading (engine/layers/packed.py)
INT8 = (Int8Weight, PackedInt8Weight)
INT4 = (Int4Weight, PackedInt4Weight)  # torch's int4 kernel; the C one where it builds
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) 4-bit values -> (rows, cols / 8) int32, AutoAWQ's GEMM order."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= values[:, col::8].to(torch.int64) << (4 * i)
    return _int32(words)


def _pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(in, out) values -> (in * bits / 32, out) int32: input 32 / bits * r + k at bits k of row r."""
    per = 32 // bits
    v = values.to(torch.int64).view(-1, per, values.shape[1])
    words = sum(v[:, k] << (bits * k) for k in range(per))
    return _int32(torch.as_tensor(words))


def _pack_gptq_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(groups, out) values -> (groups, out * bits / 32) int32, along the outputs."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    words = sum(v[..., k] << (bits * k) for k in range(per))
    return _int32(torch.as_tensor(words))


class Projection:
    """A random (out, in) grid: q, zeros and scales per group, and the float weight they stand for."""

    def __init__(self, out: int, inp: int, bits: int, group: int, seed: int, perm_seed: int | None) -> None:
        gen = torch.Generator().manual_seed(seed)
        groups = inp // group
        self.q = torch.randint(0, 2**bits, (inp, out), generator=gen)  # (in, out), as checkpoints hold it
        self.zeros = torch.randint(1, 2**bits - 1, (groups, out), generator=gen)
        self.scales = (torch.rand(groups, out, generator=gen) * 0.02 + 0.005).half()
        self.g_idx = torch.arange(inp) // group
        if perm_seed is not None:  # act-order: inputs assigned to groups in a shuffled order
            self.g_idx = self.g_idx[torch.randperm(inp, generator=torch.Generator().manual_seed(perm_seed))]
        g = self.g_idx
        self.weight = (
            ((self.q - self.zeros[g]).float() * self.scales[g].float()).t().contiguous()
        )  # (out, in)


def _write(
    folder: Path, source: Path, quantization_config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    folder.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, folder / f.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _quantized_checkpoint(
    tmp_path: Path, source: Path, method: str, bits: int = 4, group: int = 32, act_order: bool = False
) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model with its projections replaced by random grids in `method`'s layout; returns the
    folder and the float weight each projection stands for."""
    base = load_file(str(source / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(sorted(base.items())):
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS):
            tensors[name] = tensor
            continue
        out, inp = tensor.shape
        # act-order: the projections reading the same input share its permutation (as GPTQ's do)
        perm_seed = {"o_proj": 1, "down_proj": 2}.get(prefix.rsplit(".", 1)[-1], 0) if act_order else None
        p = Projection(out, inp, bits, inp if group == -1 else group, seed=i, perm_seed=perm_seed)
        exact[name] = p.weight
        if method == "awq":
            tensors[f"{prefix}.qweight"] = _pack_awq(p.q)
            tensors[f"{prefix}.qzeros"] = _pack_awq(p.zeros)
            tensors[f"{prefix}.scales"] = p.scales
        else:  # GPTQ v1: the stored zero is zero - 1
            tensors[f"{prefix}.qweight"] = _pack_gptq_rows(p.q, bits)
            tensors[f"{prefix}.qzeros"] = _pack_gptq_cols(p.zeros - 1, bits)
            tensors[f"{prefix}.scales"] = p.scales
            tensors[f"{prefix}.g_idx"] = p.g_idx.to(torch.int32)
    if method == "awq":
        config: dict[str, Any] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}  # fmt: skip
    else:
        config = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": act_order,
            "sym": False,
        }
    return _write(tmp_path / method, source, config, tensors), exact


def _served(llm: LLM, layer: int = 0) -> dict[str, Any]:
    model = llm.engine.runner.model
    return {"qkv": model.layers[layer].self_attn.qkv_proj, "down": model.layers[layer].mlp.down_proj}


@pytest.mark.parametrize(
    ("method", "bits", "group", "act_order"),
    [
        ("awq", 4, 32, False),
        ("awq", 4, 64, False),
        ("gptq", 4, 32, False),
        ("gptq", 4, 32, True),
        ("gptq", 8, 64, False),
        ("gptq", 4, -1, False),
    ],
)
def test_awq_and_gptq_checkpoints_unpack_to_their_exact_weights_and_serve_them(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    method: str,
    bits: int,
    group: int,
    act_order: bool,
) -> None:
    source = tiny_model_factory("llama")
    folder, exact = _quantized_checkpoint(tmp_path, source, method, bits, group, act_order)
    spec = read_checkpoint_quant(folder)
    assert spec is not None and spec.method == method and spec.bits == bits
    # the unpacked floats are the grids' values, bit for bit
    grids: dict[str, Any] = {}
    loaded = dict(iter_prequantized(folder, spec, torch.float32, grids))
    for name, weight in exact.items():
        assert torch.equal(loaded[name], weight), name
    assert len(grids) == 2 * 7 and all(g.bits == bits for g in grids.values())
    # served: 4-bit grids as int4 (their own values), 8-bit as per-channel int8
    llm = LLM(str(folder), enable_prefix_caching=False)
    assert llm.engine.runner.precision()["quantization"] == method
    qkv = _served(llm)["qkv"]
    assert isinstance(qkv, INT4 if bits == 4 else INT8)
    assert (qkv.input_perm is not None) == act_order if isinstance(qkv, INT4) else True
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    want = torch.cat([exact[n] for n in names])
    top = float(want.abs().amax())
    # the C int4 product's float32 scales and offsets: the grid's values to float32's rounding;
    # torch's int4 kernel: bfloat16 scales, zeros and products; 8-bit: half an int8 step per channel
    bound = {Int4Weight: 0.01 * top, PackedInt4Weight: 1e-6 * top}.get(type(qkv), top / 254 + 1e-6)
    assert float((qkv.dequantize() - want).abs().max()) <= bound
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_served_awq_model_matches_its_float_twin(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("qwen2")  # QKV bias, tied embeddings
    folder, exact = _quantized_checkpoint(tmp_path, source, "awq", group=32)
    twin = tmp_path / "twin"
    float_tensors = load_file(str(source / "model.safetensors")) | exact
    _write(twin, source, {}, float_tensors)
    config = json.loads((twin / "config.json").read_text())
    del config["quantization_config"]
    (twin / "config.json").write_text(json.dumps(config))
    prompt = [(i * 29) % 500 + 3 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = [
        LLM(str(f), enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[0]
        for f in (folder, twin)
    ]
    tops = [outs[i].outputs[0].logprobs[0] for i in range(2)]  # type: ignore[index]
    shared = set(tops[0]) & set(tops[1])
    assert len(shared) >= 4 and all(abs(tops[0][t].logprob - tops[1][t].logprob) < 0.05 for t in shared)


@pytest.mark.parametrize("layout", ["fp8-tensor", "fp8-block", "compressed-channel", "compressed-ignore"])
def test_fp8_checkpoints_read_their_scales(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, layout: str
) -> None:
    source = tiny_model_factory("llama")
    base = load_file(str(source / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        if not (name.endswith("_proj.weight")):
            tensors[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if layout == "compressed-ignore" and "down_proj" in name:
            tensors[name] = tensor.to(torch.bfloat16)  # left in float by the checkpoint's "ignore"
            exact[name] = tensor.to(torch.bfloat16).float()
            continue
        if layout == "fp8-block":  # blocks of 32 x 32, a scale each (as DeepSeek's weight_scale_inv)
            out, inp = tensor.shape
            blocks = tensor.view(out // 32, 32, inp // 32, 32)
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            codes = (blocks / scale[:, None, :, None]).view(out, inp).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.weight_scale_inv"] = scale.float()
            full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        elif layout == "fp8-tensor":
            scale = tensor.abs().amax() / 448
            codes = (tensor / scale).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.weight_scale"] = scale.reshape(()).float()
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.1)  # static activation scale: ignored
            full = scale
        else:  # compressed-tensors, one scale per output channel
            scale = tensor.abs().amax(dim=1, keepdim=True) / 448
            codes = (tensor / scale).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.weight_scale"] = scale.float()
            full = scale
        tensors[f"{prefix}.weight"] = codes
        exact[name] = codes.float() * full
    if layout.startswith("fp8"):
        config: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "static"}
        if layout == "fp8-block":
            config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
                  "ignore": ["lm_head", "re:.*down_proj"]}  # fmt: skip
    folder = _write(tmp_path / layout, source, config, tensors)
    if layout == "fp8-block":  # block scales of the wrong shape are refused by name
        broken = dict(tensors)
        name = "model.layers.0.mlp.up_proj.weight_scale_inv"
        broken[name] = broken[name][:1]
        bad = _write(tmp_path / "fp8-bad", source, config, broken)
        with pytest.raises(CheckpointFormatError, match="block scales"):
            LLM(str(bad))
    spec = read_checkpoint_quant(folder)
    assert spec is not None and spec.method == "fp8"
    loaded = dict(iter_prequantized(folder, spec, torch.float32, {}))
    for name, weight in exact.items():
        assert torch.equal(loaded[name], weight), name
    assert not any(n.endswith("input_scale") for n in loaded)
    llm = LLM(str(folder), enable_prefix_caching=False)
    assert llm.engine.runner.precision()["quantization"] == config["quant_method"]
    assert isinstance(_served(llm)["down"], INT8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "4 or 8 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "power of two"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "FP8"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_checkpoints_the_engine_cannot_read_are_refused_by_name(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, quantization_config: dict[str, Any], message: str
) -> None:
    source = tiny_model_factory("llama")
    folder = _write(
        tmp_path / "bad", source, quantization_config, load_file(str(source / "model.safetensors"))
    )
    with pytest.raises(CheckpointFormatError, match=message):
        LLM(str(folder))


def test_a_quantization_that_does_not_match_the_checkpoint_is_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("llama")
    folder, _ = _quantized_checkpoint(tmp_path, source, "gptq")
    with pytest.raises(ValueError, match=r"already quantized \(gptq\); quantization='int8'"):
        LLM(str(folder), quantization="int8")
    with pytest.raises(ValueError, match="needs a checkpoint quantized so"):
        LLM(str(source), quantization="awq")
    assert LLM(str(folder), quantization="gptq").engine.runner.precision()["quantization"] == "gptq"
    # a projection missing one of its packed tensors
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="up_proj lacks qzeros"):
        LLM(str(folder))
    # scales for other outputs than the packed weights hold
    tensors = load_file(str(folder / "model.safetensors"))
    layer0, layer1 = "model.layers.0.self_attn", "model.layers.1.mlp"
    tensors[f"{layer1}.up_proj.qzeros"] = tensors[f"{layer1}.gate_proj.qzeros"].clone()  # back in place
    k_scales = tensors[f"{layer0}.k_proj.scales"]
    tensors[f"{layer0}.k_proj.scales"] = tensors[f"{layer0}.q_proj.scales"].clone()  # 64 outputs, not 32
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="do not fit 64 inputs in groups of 32 and 32 outputs"):
        LLM(str(folder))
    # a packed tensor of the wrong kind
    tensors[f"{layer0}.k_proj.scales"] = k_scales
    tensors[f"{layer0}.k_proj.qweight"] = tensors[f"{layer0}.k_proj.qweight"].float()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="packed weights must be 2-D int32"):
        LLM(str(folder))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter path; on CUDA the gpu tests cover it"
)
@pytest.mark.parametrize(
    ("method", "bits", "act_order"), [("awq", 4, False), ("gptq", 4, True), ("gptq", 8, False)]
)
def test_the_triton_backend_serves_the_grids_exactly(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, method: str, bits: int, act_order: bool
) -> None:
    from engine.layers.quant_triton import TritonInt4Weight, TritonInt8Weight

    source = tiny_model_factory("llama")
    folder, exact = _quantized_checkpoint(tmp_path, source, method, bits, 32, act_order)
    llm = LLM(str(folder), attention_backend="triton", enable_prefix_caching=False, max_model_len=128)
    qkv, down = _served(llm)["qkv"], _served(llm)["down"]
    assert isinstance(qkv, TritonInt4Weight if bits == 4 else TritonInt8Weight)
    want = torch.cat([exact[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    if bits == 4:  # float32 scales and offsets: the grid's own values, bit for bit
        assert torch.equal(qkv.dequantize(), want)
        assert torch.equal(down.dequantize(), exact["model.layers.0.mlp.down_proj.weight"])
    else:
        assert float((qkv.dequantize() - want).abs().max()) <= float(want.abs().amax()) / 254 + 1e-6
    # the kernels compute what the served weights, dequantized, do
    from tests.engine.test_quant import float_twin_logprobs

    ours, twin = float_twin_logprobs(llm, str(source), [(i * 13) % 500 + 3 for i in range(20)])
    torch.testing.assert_close(ours, twin, atol=2e-4, rtol=0)
