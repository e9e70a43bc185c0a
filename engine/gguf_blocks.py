"""A GGUF's Q4_1 projection blocks, kept beside the float weights converted from it.

The default model ships as a GGUF whose projections are Q4_1 blocks: 32 inputs of one output row
share a float16 scale d and offset m, w = q * d + m with q in 0..15. The conversion
(engine/default_model.py) writes the float32 weights those blocks stand for, for full precision,
and, through `write_blocks`, the blocks themselves in `gguf/q4_1.safetensors` (a sub-folder, so the
weights' `*.safetensors` never include it). Served with `quantization="int4"` on the C product,
the projections are built straight from them (`read_blocks`): no float32 copy of the projections is
read, and no search for blocks that the float weights came from.

Stored per HF projection name, in HF's row order (llama.cpp permutes the rows of q and k for its
rotary layout; they are put back as transformers' GGUF loader does): `<name>.q` (out, in / 2)
uint8, byte k holding inputs 2k (low nibble) and 2k + 1 (high nibble); `<name>.d` and `<name>.m`
(out, in / 32) float16.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = Path("gguf") / "q4_1.safetensors"
GROUP = 32  # inputs per Q4_1 block
_FORMAT = "gguf-q4_1"
_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles
# GGUF tensor (blk.N.<key>.weight) -> HF module path under model.layers.N
_HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class BlocksFormatError(ValueError):
    """A blocks file that this version cannot read."""


@dataclass(frozen=True)
class Q4Blocks:
    """One (out, in) projection as Q4_1 blocks: w[o, i] = q[o, i] * d[o, i // 32] + m[o, i // 32]."""

    q: torch.Tensor  # (out, in) uint8, 0..15
    d: torch.Tensor  # (out, in / 32) float16
    m: torch.Tensor  # (out, in / 32) float16

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, as GGUF's dequantization computes it (d * q + m in float32)."""
        d = self.d.float().repeat_interleave(GROUP, 1)
        return d * self.q.float() + self.m.float().repeat_interleave(GROUP, 1)

    @classmethod
    def concat(cls, parts: list[Q4Blocks]) -> Q4Blocks:
        """Projections fused along the outputs (q, k, v; gate, up)."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


def blocks_from_gguf(raw: np.ndarray, rows: int, cols: int) -> Q4Blocks:
    """A GGUF Q4_1 tensor's bytes (rows, cols / 32 * 20) as Q4Blocks. In a block, byte j of the 16
    nibble bytes holds input j (low nibble) and input j + 16 (high)."""
    if cols % GROUP or raw.shape != (rows, cols // GROUP * _BLOCK_BYTES):
        raise BlocksFormatError(f"a Q4_1 tensor of shape ({rows}, {cols}) cannot have bytes {raw.shape}")
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(rows, cols // GROUP, _BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    nibbles = blocks[..., 4:]  # (rows, blocks, 16)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, cols)
    return Q4Blocks(q, d, m)


def unpermute_rows(blocks: Q4Blocks, heads: int) -> Q4Blocks:
    """Undo llama.cpp's rotary permutation of q's or k's rows (`heads`: that projection's heads):
    its row h*dim + 2i + j (dim = 2 * half, j in 0, 1) is HF's row h*dim + j*half + i."""
    rows = blocks.q.shape[0]
    half = rows // heads // 2
    order = torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
    return Q4Blocks(blocks.q[order], blocks.d[order], blocks.m[order])


def gguf_projection_blocks(gguf: Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4Blocks]:
    """Every Q4_1 projection of a llama-layout GGUF, by HF weight name (other tensors: skipped)."""
    from gguf import GGMLQuantizationType, GGUFReader

    found: dict[str, Q4Blocks] = {}
    for tensor in GGUFReader(str(gguf)).tensors:
        parts = tensor.name.split(".")  # blk.N.<key>.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _HF_NAMES or parts[3] != "weight":
            continue
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        blocks = blocks_from_gguf(np.asarray(tensor.data), rows, cols)
        if parts[2] in ("attn_q", "attn_k"):
            blocks = unpermute_rows(blocks, num_heads if parts[2] == "attn_q" else num_kv_heads)
        found[f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}.weight"] = blocks
    return found


def write_blocks(folder: Path, blocks: dict[str, Q4Blocks]) -> Path:
    """Store `blocks` in the folder's blocks file; returns its path."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, b in blocks.items():
        rows, cols = b.q.shape
        pairs = b.q.view(rows, cols // 2, 2)
        tensors[f"{name}.q"] = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
        tensors[f"{name}.d"], tensors[f"{name}.m"] = b.d.contiguous(), b.m.contiguous()
    path = folder / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": _FORMAT, "group": str(GROUP)})
    return path


def read_blocks(folder: Path, names: Iterable[str] | None = None) -> dict[str, Q4Blocks] | None:
    """The folder's stored blocks (only `names`, where given), or None when it has none or any of
    `names` is missing."""
    from safetensors import safe_open

    path = folder / BLOCKS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != _FORMAT or meta.get("group") != str(GROUP):
            raise BlocksFormatError(f"{path}: not a {_FORMAT} file of groups of {GROUP}")
        stored = {key.rsplit(".", 1)[0] for key in f.keys()}  # noqa: SIM118 - not a mapping
        wanted = stored if names is None else set(names)
        if not wanted <= stored:
            return None
        found: dict[str, Q4Blocks] = {}
        for name in sorted(wanted):
            packed, d, m = (f.get_tensor(f"{name}.{field}") for field in ("q", "d", "m"))
            if packed.dtype != torch.uint8 or d.dtype != torch.float16 or m.dtype != torch.float16:
                raise BlocksFormatError(f"{path}: {name} has the wrong dtypes")
            rows = packed.shape[0]
            q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(rows, -1)
            if d.shape != m.shape or d.shape != (rows, q.shape[1] // GROUP):
                raise BlocksFormatError(f"{path}: {name} has mismatched shapes")
            found[name] = Q4Blocks(q, d, m)
        return found
