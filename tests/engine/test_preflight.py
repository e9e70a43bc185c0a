"""A configuration that cannot load is refused before the server listens: one `error:` line and
exit code 2 (it was a listening server, tracebacks, and exit code 3, which asks to be restarted)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import engine.http.server
from engine.__main__ import main


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The configurations a server was started with (none should be, for a bad one)."""
    calls: list[Any] = []

    def run_server(config: Any, options: Any, **_: Any) -> int:
        calls.append(config)
        return 0

    monkeypatch.setattr(engine.http.server, "run_server", run_server)
    return calls


def _bare_folder(tmp_path: Path, model: Path) -> Path:
    """The model's config without its weights."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    return bare


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--tensor-parallel-size", "2", "--quantization", "int8"], "unquantized"),
        (["--tensor-parallel-size", "3"], "must divide"),
        (["--quantization", "awq"], "needs a checkpoint quantized so"),
        (
            ["--speculative-config", json.dumps({"method": "draft_model", "model": "/no/such/draft"})],
            "'/no/such/draft'",
        ),
        (["--model", "/no/such/model"], "/no/such/model"),
        (["--model", "BARE"], "no *.safetensors"),
        (
            ["--speculative-config", json.dumps({"method": "draft_model", "model": "BARE"})],
            "no *.safetensors",
        ),
    ],
)
def test_what_cannot_load_is_exit_2_before_the_server_starts(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, started: list[Any],
    capsys: pytest.CaptureFixture[str], options: list[str], named: str,
) -> None:  # fmt: skip
    model = tiny_model_factory("llama")
    bare = str(_bare_folder(tmp_path, model))
    capsys.readouterr()  # (building the model wrote its progress)
    given = [bare if o == "BARE" else o.replace('"BARE"', json.dumps(bare)) for o in options]
    code = main(["serve", "--model", str(model), "--port", "0", *given])
    err = capsys.readouterr().err
    assert code == 2 and not started, err
    assert err.startswith("error: ") and named in err and "Traceback" not in err, err


def test_a_configuration_that_can_load_starts_the_server(
    tiny_model_factory: Callable[..., Path], started: list[Any]
) -> None:
    draft = json.dumps({"method": "draft_model", "model": str(tiny_model_factory("llama", seed=1))})
    options = ["--tensor-parallel-size", "2", "--speculative-config", draft]
    assert main(["serve", "--model", str(tiny_model_factory("llama")), "--port", "0", *options]) == 0
    assert len(started) == 1 and started[0].tensor_parallel_size == 2


def test_the_default_model_not_converted_yet_is_left_to_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[Any]
) -> None:
    """The preflight writes nothing: converting the default model is the load's minute of work."""
    monkeypatch.setenv("SWITCHBOARD_MODEL_CACHE", str(tmp_path / "cache"))
    assert main(["serve", "--model", "default", "--port", "0"]) == 0 and len(started) == 1
    assert not (tmp_path / "cache").exists()


def test_a_model_folder_that_cannot_be_read_is_exit_2(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, started: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    model = tiny_model_factory("llama")
    capsys.readouterr()

    def unreadable(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path / "config.json"))

    monkeypatch.setattr("engine.preflight.ModelConfig.from_dir", unreadable)  # (root reads any file)
    assert main(["serve", "--model", str(model), "--port", "0"]) == 2 and not started
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Permission denied" in err and "Traceback" not in err, err


@pytest.mark.parametrize("config", [{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, [1, 2]])
def test_a_config_json_that_is_not_a_models_is_exit_2(
    tmp_path: Path, started: list[Any], capsys: pytest.CaptureFixture[str], config: object
) -> None:
    """A missing field was a KeyError (a list, an AttributeError): a traceback and exit 1."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["serve", "--model", str(folder), "--port", "0"]) == 2 and not started
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and "Traceback" not in err, err
