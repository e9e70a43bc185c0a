"""Loading the model folder's tokenizer (offline) and its chat template.

transformers' `AutoTokenizer` decides which tokenizer class a folder gets from its config.json,
tokenizer_config.json and tokenizer files, and deciding imports its whole model and tokenizer
mapping: 3-5 s of a 2-core machine's start-up, where building the chosen tokenizer takes 0.25 s.
The decision depends on nothing but those files and the transformers version, so it is made once
per folder and remembered (`tokenizer-classes.json` in the model cache): a later start builds the
remembered class the same way AutoTokenizer would (`cls.from_pretrained(folder,
local_files_only=True)`), and any change to the folder's non-weight files, or another
transformers version, asks AutoTokenizer again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.config import model_cache_dir

logger = logging.getLogger(__name__)

CLASSES_FILE = "tokenizer-classes.json"
_MAX_ENTRIES = 256  # folders remembered (the oldest forgotten first)
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_DECISION_FILES = ("config.json", "tokenizer_config.json")  # read whole; the others by size and time


def has_tokenizer(model_dir: Path) -> bool:
    """Whether the folder ships tokenizer files."""
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file()


def load_tokenizer(model_dir: Path) -> Any:
    """The folder's tokenizer as AutoTokenizer chooses it, never touching the network."""
    key = _folder_key(model_dir)
    known = _remembered(key) if key is not None else None
    if known is not None:
        try:
            return known.from_pretrained(str(model_dir), local_files_only=True)
        except Exception:  # an entry that no longer builds: decide again
            logger.info("the remembered tokenizer class for %s failed; asking AutoTokenizer", model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if key is not None:
        _remember(key, type(tokenizer))
    return tokenizer


def _folder_key(model_dir: Path) -> str | None:
    """A digest of what AutoTokenizer's choice depends on (None: the folder cannot be read)."""
    try:
        version = importlib.metadata.version("transformers")
        digest = hashlib.sha256(f"{version}\0{model_dir.resolve()}".encode())
        for path in sorted(model_dir.iterdir()):
            if not path.is_file() or path.name.endswith(_WEIGHTS):
                continue
            if path.name in _DECISION_FILES:
                digest.update(b"\0%s\0%s" % (path.name.encode(), path.read_bytes()))
            else:
                stat = path.stat()
                digest.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        return digest.hexdigest()
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None


def _classes_path() -> Path:
    return model_cache_dir() / CLASSES_FILE


def _read_classes() -> dict[str, str]:
    try:
        data = json.loads(_classes_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _remembered(key: str) -> Any:
    """The class remembered for `key`: only a transformers tokenizer class, else None."""
    name = _read_classes().get(key)
    if name is None:
        return None
    module_name, _, class_name = name.rpartition(":")
    if not module_name.startswith("transformers."):  # never import anything else from a cache file
        return None
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _remember(key: str, cls: type) -> None:
    """Add `key` → `cls` (atomically replaced; a lost race only means deciding once more)."""
    if not cls.__module__.startswith("transformers."):
        return
    classes = _read_classes()
    classes.pop(key, None)
    classes[key] = f"{cls.__module__}:{cls.__qualname__}"
    while len(classes) > _MAX_ENTRIES:
        classes.pop(next(iter(classes)))
    path = _classes_path()
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-classes.")
        with os.fdopen(fd, "w") as f:
            json.dump(classes, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:  # a read-only cache: every start asks AutoTokenizer, as before
        logger.debug("could not remember the tokenizer class in %s: %s", path, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
