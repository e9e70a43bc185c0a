"""Reading safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Container, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, in shard order."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) missing: {', '.join(str(m) for m in missing)}")
    return files


def iter_weights(
    model_dir: Path, dtype: torch.dtype, skip: Container[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint but `skip`'s (never read), cast to
    `dtype`."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in skip:
                    yield name, f.get_tensor(name).to(dtype)
