"""Pre-quantized checkpoints in their published Hugging Face layouts: AWQ, GPTQ and FP8.

A checkpoint says how it was quantized in config.json's `quantization_config`; the engine reads it
(`read_checkpoint_quant`) and unpacks each projection into one form, `Grid` (integer values, a
zero and a scale per group of inputs, and which group each input belongs to). Layouts:
- AWQ (`quant_method: awq`, AutoAWQ's GEMM version, 4 bits): `qweight` int32 (in, out / 8) and
  `qzeros` int32 (in / group, out / 8), eight 4-bit values per int32 along the outputs in the order
  0, 2, 4, 6, 1, 3, 5, 7; `scales` float16 (in / group, out); w = (q - zero) * scale.
- GPTQ (`quant_method: gptq`, 4 or 8 bits; AutoGPTQ / Optimum / GPTQModel): `qweight` int32
  (in * bits / 32, out) packed along the inputs, `qzeros` int32 (groups, out * bits / 32) packed
  along the outputs, both lowest bits first; `scales` float16 (groups, out); `g_idx` int32 (in,)
  the group of each input (act-order checkpoints permute it); the stored zero is zero - 1 unless
  `checkpoint_format` is `gptq_v2`; `group_size: -1` means one group per output channel.
- FP8 e4m3 weights, as vLLM reads them (`quant_method: fp8`: `weight_scale` per tensor, or
  `weight_scale_inv` per 128 x 128 block with `weight_block_size`) or as compressed-tensors writes
  them (`format: float-quantized`, `weight_scale` per tensor, per channel or per block).
Activation scales (`input_scale`) and checkpoint KV scales are ignored: activations stay in
bfloat16/float32 and the KV cache computes its own scales per token (engine/layers/kv_cache.py).

The projections are then served by `engine/layers/quant.py` (4-bit grids as they are; 8-bit and FP8
through per-channel int8) on the CPU, or dequantized to the model's dtype on the GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.weights import checkpoint_files

PREQUANTIZED = ("awq", "gptq", "fp8", "compressed-tensors")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column k of a packed int32 sits in nibble [k]
_SKIPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale", ".weight_zero_point")


class CheckpointFormatError(ValueError):
    """A quantized checkpoint the engine cannot read (a method, bit width or layout it lacks)."""


@dataclass(frozen=True)
class CheckpointQuant:
    """What config.json's quantization_config says, validated."""

    source: str  # config.json's quant_method: awq | gptq | fp8 | compressed-tensors
    method: str  # the layout read: awq | gptq | fp8 (compressed-tensors FP8 included)
    bits: int  # 4 or 8
    group_size: int  # inputs per group; -1: a whole row (AWQ/GPTQ)
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    block: tuple[int, int] | None = None  # FP8 block scales (out, in)
    fp8_scale_name: str = "weight_scale"


@dataclass
class Grid:
    """One (out, in) projection: w[o, i] = (q[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]]."""

    q: torch.Tensor  # (out, in) int32
    zeros: torch.Tensor  # (out, groups) float32
    scales: torch.Tensor  # (out, groups) float32
    g_idx: torch.Tensor  # (in,) int64
    bits: int
    group_size: int  # inputs per group when the groups are contiguous (g_idx == i // group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out, in)."""
        return (self.q.float() - self.zeros[:, self.g_idx]) * self.scales[:, self.g_idx]

    @classmethod
    def concat(cls, parts: list[Grid]) -> Grid:
        """Shards fused along the outputs (q, k, v; gate, up): one grouping of the inputs."""
        first = parts[0]
        for p in parts[1:]:
            if p.bits != first.bits or not torch.equal(p.g_idx, first.g_idx):
                raise CheckpointFormatError("fused projections (q/k/v, gate/up) must share input groups")
        return cls(
            torch.cat([p.q for p in parts]),
            torch.cat([p.zeros for p in parts]),
            torch.cat([p.scales for p in parts]),
            first.g_idx,
            first.bits,
            first.group_size,
        )


def read_checkpoint_quant(model_dir: Path) -> CheckpointQuant | None:
    """The checkpoint's quantization, or None for a float checkpoint; refuses what it cannot read."""
    config = json.loads((model_dir / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise CheckpointFormatError("config.json's quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm" or qc.get("bits", 4) != 4:
            raise CheckpointFormatError("AWQ checkpoints are read in AutoAWQ's GEMM layout with 4 bits")
        if qc.get("zero_point", True) is not True:
            raise CheckpointFormatError("AWQ checkpoints without zero points are not supported")
        return CheckpointQuant("awq", "awq", 4, _group_size(qc.get("group_size", 128)))
    if method == "gptq":
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise CheckpointFormatError(f"GPTQ checkpoints of 4 or 8 bits are supported, got {bits!r}")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointFormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        group = _group_size(qc.get("group_size", 128))
        return CheckpointQuant("gptq", "gptq", bits, group, zero_offset=1 if fmt == "gptq" else 0)
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise CheckpointFormatError("FP8 checkpoints are read in e4m3")
        block = qc.get("weight_block_size")
        if block is None:
            return CheckpointQuant("fp8", "fp8", 8, -1)
        return CheckpointQuant("fp8", "fp8", 8, -1, block=_block(block), fp8_scale_name="weight_scale_inv")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise CheckpointFormatError(
        f"quantization method {method or '(none)'!r} is not supported: the engine reads awq, gptq, fp8 "
        "and compressed-tensors (FP8) checkpoints"
    )


def _group_size(value: Any) -> int:
    if not isinstance(value, int) or (value != -1 and (value < 1 or value & (value - 1))):
        raise CheckpointFormatError(f"group_size must be -1 or a power of two, got {value!r}")
    return value


def _block(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise CheckpointFormatError(f"weight_block_size must be two positive integers, got {value!r}")
    return value[0], value[1]


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    schemes = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    if fmt not in ("float-quantized", "naive-quantized") or not schemes:
        raise CheckpointFormatError(
            f"compressed-tensors checkpoints are read in FP8 (format float-quantized), got format {fmt!r}"
        )
    for w in schemes:
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise CheckpointFormatError("compressed-tensors checkpoints are read with 8-bit float weights")
        if w.get("strategy") not in ("tensor", "channel", "block"):
            strategy = w.get("strategy")
            raise CheckpointFormatError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    block = schemes[0].get("block_structure") if schemes[0].get("strategy") == "block" else None
    return CheckpointQuant("compressed-tensors", "fp8", 8, -1, block=None if block is None else _block(block))


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values, lowest bits first, laid out along `dim`."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise CheckpointFormatError(
            f"packed weights must be 2-D int32, got {packed.dtype} {tuple(packed.shape)}"
        )
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., per_word)
    if dim == 0:  # (rows, cols, per_word) -> (rows * per_word, cols)
        return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def _awq_grid(t: dict[str, torch.Tensor], group_size: int) -> Grid:
    order = torch.tensor(AWQ_REVERSE_ORDER)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        values = _unpack(packed, 4, dim=1).view(packed.shape[0], -1, 8)
        return values[..., order].reshape(packed.shape[0], -1)

    q = unpack(t["qweight"])  # (in, out)
    in_features = q.shape[0]
    group = in_features if group_size == -1 else group_size
    zeros = unpack(t["qzeros"]).float()  # (groups, out)
    scales = t["scales"].float()
    _check_groups(zeros, scales, q, group)
    g_idx = torch.arange(in_features) // group
    return Grid(q.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous(), g_idx, 4, group)


def _gptq_grid(t: dict[str, torch.Tensor], spec: CheckpointQuant) -> Grid:
    q = _unpack(t["qweight"], spec.bits, dim=0)  # (in, out)
    in_features, out_features = q.shape
    zeros = (_unpack(t["qzeros"], spec.bits, dim=1)[:, :out_features] + spec.zero_offset).float()
    scales = t["scales"].float()
    group = in_features if spec.group_size == -1 else spec.group_size
    _check_groups(zeros, scales, q, group)
    contiguous = torch.arange(in_features) // group
    g_idx = t["g_idx"].to(torch.int64) if "g_idx" in t else contiguous
    if g_idx.shape != (in_features,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
        raise CheckpointFormatError(f"g_idx must give each of the {in_features} inputs a group")
    return Grid(q.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous(), g_idx, spec.bits, group)


def _check_groups(zeros: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, group: int) -> None:
    """zeros and scales (groups, out) fit q (in, out) in groups of `group` inputs."""
    in_features, out_features = q.shape
    groups = -(-in_features // group)
    if scales.dim() != 2 or scales.shape != (groups, out_features) or zeros.shape != scales.shape:
        raise CheckpointFormatError(
            f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit {in_features} inputs "
            f"in groups of {group} and {out_features} outputs"
        )


def _fp8_weight(t: dict[str, torch.Tensor], spec: CheckpointQuant) -> torch.Tensor:
    weight = t.get("weight")
    scale = t.get(spec.fp8_scale_name, t.get("weight_scale"))
    if weight is None or weight.dtype != torch.float8_e4m3fn or scale is None:
        raise CheckpointFormatError("FP8 weights must be float8_e4m3fn with a weight scale")
    w = weight.float()
    s = scale.float()
    if spec.block is not None:  # (ceil(out / bo), ceil(in / bi)) -> one scale per block
        bo, bi = spec.block
        blocks = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
        if tuple(s.shape) != blocks:
            raise CheckpointFormatError(f"block scales {tuple(s.shape)} do not fit a weight {tuple(w.shape)}")
        s = s.repeat_interleave(bo, dim=0)[: w.shape[0]].repeat_interleave(bi, dim=1)[:, : w.shape[1]]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)  # one scale per output channel
        if s.shape[0] != w.shape[0]:
            shapes = f"{tuple(scale.shape)} does not fit a weight {tuple(w.shape)}"
            raise CheckpointFormatError(f"weight_scale {shapes}")
    return w * s


_PACKED_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "fp8": ("weight", "weight_scale", "weight_scale_inv"),
}
_LINEAR = re.compile(r"^(?P<prefix>.*\.(?:q|k|v|o|gate|up|down)_proj)\.(?P<leaf>\w+)$")


def iter_prequantized(
    model_dir: Path, spec: CheckpointQuant, dtype: torch.dtype, grids: dict[str, Grid]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint as float tensors (`<proj>.weight` dequantized, everything else cast to
    `dtype`); the 4/8-bit grids of AWQ/GPTQ projections also land in `grids` by their weight name.

    A projection's packed parts are gathered over every shard first (a shard boundary may fall
    between them); they are a fraction of the float weights' size."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    need = _PACKED_SUFFIXES[spec.method]
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                match = _LINEAR.match(name)
                if match is None or match["leaf"] not in need:
                    yield name, f.get_tensor(name).to(dtype)
                else:
                    packed.setdefault(match["prefix"], {})[match["leaf"]] = f.get_tensor(name)
    for prefix, parts in packed.items():
        yield _finish(prefix, parts, spec, dtype, grids)


def _finish(
    prefix: str,
    parts: dict[str, torch.Tensor],
    spec: CheckpointQuant,
    dtype: torch.dtype,
    grids: dict[str, Grid],
) -> tuple[str, torch.Tensor]:
    name = f"{prefix}.weight"
    if spec.method == "fp8":
        weight = parts.get("weight")
        if weight is not None and weight.dtype != torch.float8_e4m3fn and len(parts) == 1:
            return name, weight.to(dtype)  # a layer the checkpoint left unquantized ("ignore")
        return name, _fp8_weight(parts, spec).to(dtype)
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in parts]
    if missing:
        raise CheckpointFormatError(f"{prefix} lacks {', '.join(missing)} of its {spec.method} tensors")
    grid = _awq_grid(parts, spec.group_size) if spec.method == "awq" else _gptq_grid(parts, spec)
    grids[name] = grid
    return name, grid.dequantize().to(dtype)
