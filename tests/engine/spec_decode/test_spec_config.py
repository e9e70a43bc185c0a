"""speculative_config: vLLM's names, defaults, and a clear error for everything else."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.spec_decode.config import SpeculativeConfig


def test_dict_and_json_text_give_the_same_config_with_lookup_defaults() -> None:
    a = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    b = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}')
    assert a.speculative_config == b.speculative_config
    assert isinstance(a.speculative_config, SpeculativeConfig)
    assert a.speculative_config.lookup_range == (2, 4)
    assert SpeculativeConfig.parse({"prompt_lookup_max": 1}).lookup_range == (1, 1)
    assert SpeculativeConfig.parse({"prompt_lookup_min": 6}).lookup_range == (6, 6)
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"method": "draft_model"}, "must name the draft model"),
        ({"model": "/m"}, "for method 'draft_model' only"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
        ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be int"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be int"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed prompt_lookup_max"),
        ({"prompt_lookup_max": 1000}, r"prompt_lookup_max must be in \[1, 64\]"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
        ({"min_acceptance_rate": 1.5}, r"min_acceptance_rate must be in \[0, 1\)"),
        ({"draft_tensor_parallel_size": 1}, "unknown key"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]


def test_environment_variable_is_read_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_ENGINE_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 3}')
    config = EngineConfig.from_env()
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.num_speculative_tokens == 3
