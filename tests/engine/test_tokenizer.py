"""A folder's tokenizer class is decided by AutoTokenizer once, then built directly: the same tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from engine import tokenizer as engine_tokenizer
from engine.tokenizer import CLASSES_FILE, load_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines  ", "émoji 🚀 and 中文", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SWITCHBOARD_MODEL_CACHE", str(folder))
    return folder


@pytest.fixture
def auto_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts AutoTokenizer.from_pretrained calls (it still runs)."""
    calls: list[str] = []
    original = transformers.AutoTokenizer.from_pretrained

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return calls


def _folder(tmp_path: Path, source: Path, name: str, **edits: Any) -> Path:
    """The source's tokenizer files and config in a new folder, tokenizer_config.json edited."""
    out = tmp_path / name
    out.mkdir()
    for file in ("tokenizer.json", "chat_template.jinja", "config.json"):
        shutil.copy(source / file, out / file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **edits}))
    return out


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert [a.encode(t) for t in TEXTS] == [b.encode(t) for t in TEXTS]
    assert a.decode(a.encode(TEXTS[2])) == b.decode(b.encode(TEXTS[2]))
    assert a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == b.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    assert a.all_special_ids == b.all_special_ids and a.eos_token_id == b.eos_token_id
    assert a.get_vocab() == b.get_vocab() and a.model_max_length == b.model_max_length


@pytest.mark.parametrize(("declared", "model_type"), [(None, None), ("Qwen2Tokenizer", "qwen2")])
def test_the_class_is_decided_once_and_the_remembered_one_builds_the_same_tokenizer(
    tmp_path: Path, tiny_chat_model: Path, cache: Path, auto_calls: list[str], declared: str | None,
    model_type: str | None,
) -> None:  # fmt: skip
    edits = {"tokenizer_class": declared} if declared else {}
    folder = _folder(tmp_path, tiny_chat_model, "tok", **edits)
    if model_type:  # a model type whose tokenizer class AutoTokenizer specializes
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    first = load_tokenizer(folder)
    assert auto_calls == [str(folder)]
    assert len(json.loads((cache / CLASSES_FILE).read_text())) == 1
    second = load_tokenizer(folder)
    assert auto_calls == [str(folder)]  # not asked again
    _same(first, second)
    if declared:
        assert type(second).__name__ == declared


def test_a_changed_folder_a_damaged_file_or_a_foreign_entry_asks_autotokenizer_again(
    tmp_path: Path, tiny_chat_model: Path, cache: Path, auto_calls: list[str]
) -> None:
    folder = _folder(tmp_path, tiny_chat_model, "tok")
    load_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 2048}))
    changed = load_tokenizer(folder)
    assert len(auto_calls) == 2 and changed.model_max_length == 2048
    assert len(json.loads((cache / CLASSES_FILE).read_text())) == 2  # both versions remembered

    (cache / CLASSES_FILE).write_text("{not json")
    load_tokenizer(folder)
    assert len(auto_calls) == 3

    entries = json.loads((cache / CLASSES_FILE).read_text())
    (cache / CLASSES_FILE).write_text(json.dumps({key: "os:system" for key in entries}))
    load_tokenizer(folder)  # only transformers' tokenizer classes are ever imported from the file
    assert len(auto_calls) == 4


def test_a_read_only_cache_still_loads(tmp_path: Path, tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch,
                                       auto_calls: list[str]) -> None:  # fmt: skip
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    monkeypatch.setenv("SWITCHBOARD_MODEL_CACHE", str(blocked / "cache"))  # cannot be created
    folder = _folder(tmp_path, tiny_chat_model, "tok")
    assert load_tokenizer(folder).encode("hi") and load_tokenizer(folder).encode("hi")
    assert len(auto_calls) == 2
    assert list(tmp_path.glob("**/.tokenizer-classes.*")) == []


def test_the_remembered_class_spares_a_start_the_auto_mappings(tmp_path: Path, tiny_chat_model: Path) -> None:
    folder = _folder(tmp_path, tiny_chat_model, "tok")
    env = {**os.environ, "SWITCHBOARD_MODEL_CACHE": str(tmp_path / "cache")}
    probe = (
        "import sys; from pathlib import Path; from engine.tokenizer import load_tokenizer; "
        f"load_tokenizer(Path({str(folder)!r})); "
        "print('transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    command = [sys.executable, "-c", probe]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert [r.stdout.strip() for r in runs] == ["True", "False"]


def test_the_module_keeps_weights_out_of_the_key(tmp_path: Path, tiny_chat_model: Path) -> None:
    folder = _folder(tmp_path, tiny_chat_model, "tok")
    key = engine_tokenizer._folder_key(folder)
    (folder / "model.safetensors").write_bytes(b"weights change without changing the tokenizer")
    assert engine_tokenizer._folder_key(folder) == key
    (folder / "special_tokens_map.json").write_text("{}")
    assert engine_tokenizer._folder_key(folder) != key
