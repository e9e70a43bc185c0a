"""EngineConfig validation, environment overrides and the model cache location."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig, model_cache_dir


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=12),
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(kv_cache_memory=0),
        dict(gpu_memory_utilization=1.5),
        dict(dtype="int8"),
        dict(device="tpu"),
    ],
)
def test_invalid_options_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**bad)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    config = EngineConfig()
    with pytest.raises(AttributeError):
        config.block_size = 32  # type: ignore[misc]


def test_from_env_reads_prefixed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_KV_CACHE_MEMORY", "1048576")
    config = EngineConfig.from_env(block_size=32)
    assert (config.max_num_seqs, config.enable_prefix_caching, config.kv_cache_memory, config.block_size) == (
        8,
        False,
        1048576,
        32,
    )
    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "many")
    with pytest.raises(ValueError, match="must be an integer"):
        EngineConfig.from_env()


def test_from_env_takes_an_empty_variable_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose's `${VAR:-}` sets a variable empty: the default holds, as for the HTTP limits."""
    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_DTYPE", "  ")
    config = EngineConfig.from_env()
    assert (config.max_num_seqs, config.dtype) == (EngineConfig().max_num_seqs, EngineConfig().dtype)


def test_model_cache_dir_is_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWITCHBOARD_MODEL_CACHE", str(tmp_path / "models"))
    assert model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("SWITCHBOARD_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache_dir() == tmp_path / "switchboard" / "models"


def test_command_line_reads_engine_variables_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.__main__ import _config, parse_args

    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_ATTENTION_BACKEND", "torch")
    from_env = _config(parse_args(["serve"]))
    assert (from_env.max_num_seqs, from_env.enable_prefix_caching, from_env.attention_backend) == (
        7,
        False,
        "torch",
    )
    assert from_env.model == "default" and from_env.block_size == 16  # untouched defaults
    flags = _config(parse_args(["serve", "--max-num-seqs", "9", "--model", "/m", "--enforce-eager"]))
    assert (flags.max_num_seqs, flags.model, flags.enforce_eager) == (9, "/m", True)
    monkeypatch.setenv("SWITCHBOARD_ENGINE_ENABLE_PREFIX_CACHING", "true")
    assert _config(parse_args(["generate", "hi", "--no-prefix-caching"])).enable_prefix_caching is False


def test_a_flag_given_its_default_value_still_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.__main__ import _config, parse_args

    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("SWITCHBOARD_ENGINE_MODEL", "/from-env")
    argv = ["serve", "--max-num-seqs", "64", "--attention-backend=auto", "--model", "default"]
    config = _config(parse_args(argv))  # 64, auto and default are also the flags' defaults
    assert (config.max_num_seqs, config.attention_backend, config.model) == (64, "auto", "default")
    assert _config(parse_args(["eval", "--max-num-seqs", "64"])).max_num_seqs == 64
    assert _config(parse_args(["generate", "hi"])).max_num_seqs == 7  # not given: the variable


def test_bad_engine_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.__main__ import _config, parse_args

    monkeypatch.setenv("SWITCHBOARD_ENGINE_MAX_NUM_SEQS", "many")
    with pytest.raises(ValueError, match="SWITCHBOARD_ENGINE_MAX_NUM_SEQS must be an integer"):
        _config(parse_args(["serve"]))
