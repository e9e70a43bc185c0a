"""Policy files: strict validation with errors that name the path."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy import PolicyError, load_policy, parse_policy

GOOD = """
backends:
  local: {type: engine, urls: ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]}
models:
  small: {backend: local, model: SmolLM2-135M-Instruct}
  direct: {backend: local}
"""


def test_the_shipped_default_policy_is_valid() -> None:
    policy = load_policy(Path("policies/default.yaml"))
    assert "SmolLM2-135M-Instruct" in policy.models


def test_upstream_model_defaults_to_the_exposed_name() -> None:
    policy = parse_policy(GOOD)
    assert policy.upstream_model("small") == "SmolLM2-135M-Instruct"
    assert policy.upstream_model("direct") == "direct"
    assert len(policy.backends["local"].urls) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("backends: {}\nmodels: {}", "backends: "),
        (
            GOOD.replace("backend: local}", "backend: nowhere}", 1),
            "models.direct.backend: unknown backend 'nowhere'",
        ),
        (GOOD.replace("type: engine,", "type: engine, colour: red,"), "backends.local.colour: unknown key"),
        (GOOD.replace('"http://127.0.0.1:8002"', '"ftp://x"'), "urls[1]: must start with http"),
        (GOOD + "extra_top_level: 1\n", "extra_top_level: unknown key"),
        ("- a list", "must be a mapping"),
        ("backends: [unclosed", "not valid YAML"),
    ],
)
def test_invalid_policies_name_the_offending_path(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert message in str(info.value) and str(info.value).startswith("p.yaml: ")


def test_missing_policy_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(tmp_path / "none.yaml")
