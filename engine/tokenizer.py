"""Loading the model folder's tokenizer (offline) and its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def has_tokenizer(model_dir: Path) -> bool:
    """Whether the folder ships tokenizer files."""
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file()


def load_tokenizer(model_dir: Path) -> Any:
    """The folder's fast tokenizer (transformers), never touching the network."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
