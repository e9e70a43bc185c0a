"""Policy files: strict validation with errors that name the path."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.backends.health import BreakerState, CircuitBreaker
from gateway.config.policy import (
    MAX_POLICY_BYTES,
    Breaker,
    Policy,
    PolicyError,
    load_policy,
    parse_policy,
    read_policy_text,
)

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
    assert {"auto", "fast", "smart"} <= set(policy.routes)


def test_the_commented_example_uses_every_feature_and_is_valid() -> None:
    policy = load_policy(Path("policies/example.yaml"))
    assert policy.routes["auto"].tiers and policy.routes["fast"].candidates
    assert {o.data_residency for o in policy.overrides} == {"any", "self_hosted_only"}
    assert policy.health_for("gpu-pool").max_queue_depth == 32 and policy.health.max_queue_depth is None
    assert policy.models["llama-8b"].capabilities.vision is False and policy.models["llama-8b"].context_length
    text = re.sub(r"#.*", "", Path("policies/example.yaml").read_text())
    keys = set(re.findall(r"(?:^\s*|[{,]\s*|-\s+)(\w+):", text, re.MULTILINE))  # block and flow keys
    schema = _schema_names(Policy, set(), literals=False)
    assert schema - keys == set()  # architecture.md and the compose policy send readers there for every key


_ROUTES = """  hosted: {backend: api}
routes:
  auto:
    tiers:
      - {name: simple, threshold: 0, candidates: [small]}
      - {name: complex, threshold: 0.6, candidates: [hosted]}
    fallbacks: [direct]
overrides:
  - {team: legal, tier: complex}
"""
ROUTED = (GOOD + _ROUTES).replace("models:", "  api: {type: hosted, model: openai/x}\nmodels:")


def test_a_routed_policy_parses_with_tiers_fallbacks_and_overrides() -> None:
    policy = parse_policy(ROUTED)
    assert [t.threshold for t in policy.routes["auto"].tiers] == [0, 0.6]
    assert policy.exposed() == ["small", "direct", "hosted", "auto"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("threshold: 0.6", "threshold: 1.5"), "routes.auto.tiers[1].threshold: must be between 0 and 1"),
        (("threshold: 0.6", "threshold: 0"), "routes.auto.tiers[1].threshold: must be above tiers[0]"),
        (("threshold: 0,", "threshold: 0.2,"), "routes.auto.tiers[0].threshold: the first tier must"),
        (("candidates: [hosted]", "candidates: [x]"), "auto.tiers[1].candidates[0]: unknown model 'x'"),
        (("fallbacks: [direct]", "fallbacks: [gone]"), "routes.auto.fallbacks[0]: unknown model 'gone'"),
        (("tier: complex}", "tier: huge}"), "overrides[0].tier: unknown tier 'huge'"),
        (("{team: legal, tier: complex}", "{team: legal}"), "overrides[0]: an override must set tier"),
        (("{team: legal, tier: complex}", "{team: a, key: b, tier: x}"), "overrides[0]: give exactly one"),
        (("  auto:\n", "  small:\n"), "routes.small: already a name in models"),
        (("    fallbacks: [direct]", "    fallbacks: [direct]\n    retries: {count: -1}"),
         "routes.auto.retries.count: Input should be greater than or equal to 0"),
    ],
)  # fmt: skip
def test_routing_errors_name_their_path(change: tuple[str, str], message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(ROUTED.replace(*change), "p.yaml")
    assert message in str(info.value)


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
        (GOOD.replace("type: engine,", "type: engine, load_slack: -1,"), "backends.local.load_slack: "),
        (GOOD + "extra_top_level: 1\n", "extra_top_level: unknown key"),
        ("- a list", "must be a mapping"),
        ("backends: [unclosed", "not valid YAML"),
    ],
)
def test_invalid_policies_name_the_offending_path(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert message in str(info.value) and str(info.value).startswith("p.yaml: ")


def test_a_model_declares_capabilities_and_context_length() -> None:
    declared = "capabilities: {tools: true, vision: false}, context_length: 8192"
    policy = parse_policy(GOOD.replace("model: SmolLM2-135M-Instruct}", f"model: x, {declared}}}"))
    small = policy.models["small"]
    assert small.capabilities.tools is True and small.capabilities.vision is False
    assert small.capabilities.json_schema is None  # unset: left to what the backend reports
    assert small.context_length == 8192 and policy.models["direct"].context_length is None


@pytest.mark.parametrize(("declared", "message"), [
    ("capabilities: {tools: maybe}", "models.small.capabilities.tools: must be true or false"),
    ("capabilities: {tools: 1}", "models.small.capabilities.tools: must be true or false"),
    ('capabilities: {vision: "false"}', "models.small.capabilities.vision: must be true or false"),
    ("capabilities: {tool: true}", "models.small.capabilities.tool: unknown capability (known: tools, "
                                   "json_schema, json_object, vision, logprobs)"),
    ("capabilities: [tools]", "models.small.capabilities: "),
    ("context_length: 0", "models.small.context_length: Input should be greater than or equal to 1"),
    ("context_length: 8k", "models.small.context_length: Input should be a valid integer"),
    ("context_length: 1.5", "models.small.context_length: Input should be a valid integer"),
    ("context_length: true", "models.small.context_length: Input should be a valid integer"),
])  # fmt: skip
def test_bad_capability_values_are_errors_that_name_the_key(declared: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(
            GOOD.replace("model: SmolLM2-135M-Instruct}", f"model: SmolLM2-135M-Instruct, {declared}}}")
        )
    assert message in str(info.value)


def test_missing_policy_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(tmp_path / "none.yaml")


def test_a_backends_breaker_override_gives_its_replicas_a_working_breaker() -> None:
    policy = parse_policy("""
backends:
  local:
    type: engine
    urls: ["http://127.0.0.1:8001"]
    health: {breaker: {cooldown: 9, consecutive_failures: 1}}
models:
  small: {backend: local}
""")  # fmt: skip
    breaker = policy.health_for("local").breaker
    assert isinstance(breaker, Breaker)  # was a dict: its replicas failed on their first failure
    assert (breaker.cooldown, breaker.consecutive_failures, breaker.window) == (9, 1, 10)  # unset: defaults
    replica = CircuitBreaker(breaker, lambda: 0.0)
    replica.record(False)
    assert replica.state is BreakerState.OPEN


def _schema_names(model: type[BaseModel], seen: set[type[BaseModel]], literals: bool = True) -> set[str]:
    """Every key of `model` and of the models inside it, and every allowed literal value (`literals`)."""
    names: set[str] = set()
    seen.add(model)
    for name, field in model.model_fields.items():
        names.add(name)
        stack: list[object] = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                if tp not in seen:
                    names |= _schema_names(tp, seen, literals)
            elif typing.get_origin(tp) is typing.Literal and literals:
                names |= {str(v) for v in typing.get_args(tp)}
            elif typing.get_origin(tp) is typing.Annotated:
                stack.append(typing.get_args(tp)[0])
            elif typing.get_origin(tp) in (list, dict, types.UnionType, typing.Union):
                stack.extend(typing.get_args(tp))
    return names


def test_docs_policy_md_documents_every_key_and_value_of_the_schema() -> None:
    text = re.sub(r"```.*?```", "", Path("docs/policy.md").read_text(), flags=re.DOTALL)  # no fenced blocks
    code = re.findall(r"`([^`\n]+)`", text)  # `cooldown`, `type: engine`, ...
    documented = {word for span in code for word in re.findall(r"[a-z_]+", span)}
    names = _schema_names(Policy, set())
    assert {"log_bodies", "cooldown", "tokenizer", "total", "self_hosted_only"} <= names  # the walk works
    assert names - documented == set()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:99999", "not a valid URL (Port out of range"),
        ("http://[::1", "not a valid URL (Invalid IPv6 URL)"),
        ("http://", "has no host"),
        ("http://host:port", "not a valid URL (Port could not be cast"),
        ("http://host:0", "port must be 1 to 65535"),
        ("http://host:8001/v1?x=1", "must not have a query or fragment"),
        ("http://host:8001/a b", "must not contain spaces or control characters"),
    ],
)
def test_an_engine_url_the_pool_could_not_open_is_a_policy_error(url: str, message: str) -> None:
    """These passed `policy check` and then raised while pools were built: serve crashed, a reload
    killed the watcher."""
    with pytest.raises(PolicyError) as info:
        parse_policy(GOOD.replace('"http://127.0.0.1:8002"', f'"{url}"'), "p.yaml")
    assert f"p.yaml: backends.local.urls[1]: {message}" in str(info.value)


def test_credentials_in_a_url_are_refused_without_repeating_them() -> None:
    """A password in a URL would be shown wherever the URL is (logs, metric labels, the console)."""
    for text in (
        GOOD.replace('"http://127.0.0.1:8002"', '"http://admin:s3cret@127.0.0.1:8002"'),
        GOOD.replace(
            "models:", "  api: {type: hosted, model: openai/x, base_url: 'http://u:s3cret@h/v1'}\nmodels:"
        ),
    ):
        with pytest.raises(PolicyError, match=r"must not hold credentials.*api_key_env") as info:
            parse_policy(text, "p.yaml")
        assert "s3cret" not in str(info.value)


def test_a_hosted_base_url_is_checked_like_an_engine_url_but_may_have_a_query() -> None:
    hosted = "  api: {type: hosted, model: openai/x, base_url: 'URL'}\nmodels:"
    with pytest.raises(PolicyError, match=r"backends.api.base_url: not a valid URL \(Invalid IPv6"):
        parse_policy(GOOD.replace("models:", hosted.replace("URL", "http://[::1")))
    policy = parse_policy(GOOD.replace("models:", hosted.replace("URL", "https://h/v1?api-version=1")))
    assert policy.backends["api"].base_url == "https://h/v1?api-version=1"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "name", ["GATEWAY_MASTER_KEY", "GATEWAY_KEY_SECRET", "gateway_database_url", "OTEL_EXPORTER_OTLP_HEADERS"]
)
def test_api_key_env_may_not_name_the_gateways_own_secrets(name: str) -> None:
    """The gateway would send that secret as a bearer key to whatever URL the policy names."""
    engine = GOOD.replace("type: engine,", f"type: engine, api_key_env: {name},")
    hosted_backend = f"  api: {{type: hosted, model: openai/x, api_key_env: {name}}}\n"
    hosted = GOOD.replace("models:", hosted_backend + "models:")
    for text, where in ((engine, "backends.local"), (hosted, "backends.api")):
        with pytest.raises(PolicyError, match=f"{where}.api_key_env: '{name}' is one of the gateway's own"):
            parse_policy(text)
    assert parse_policy(GOOD.replace("type: engine,", "type: engine, api_key_env: ENGINE_KEY,"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("backends: " + "[" * 1000 + "]" * 1000, "p.yaml: not valid YAML: nested too deeply"),
        ("backends: " + "9" * 5000, "p.yaml: not valid YAML: Exceeds the limit (4300 digits)"),
        # the last of two was kept without a word, the first (an invalid one, even) dropped
        (
            GOOD.replace("backends:\n", "backends:\n  local: {type: nope}\n", 1),
            "the key 'local' is given twice",
        ),
        (GOOD + "models:\n  other: {backend: local}\n", "the key 'models' is given twice"),
    ],
)
def test_yaml_the_parser_cannot_build_is_a_policy_error(text: str, message: str) -> None:
    """A RecursionError here ended the hot-reload watcher: no later edit was ever applied."""
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert message in str(info.value)


def test_a_policy_file_over_the_size_cap_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(GOOD.encode() + b"#" * MAX_POLICY_BYTES)
    with pytest.raises(PolicyError, match=r"big.yaml: larger than the limit, 8,388,608 bytes"):
        load_policy(path)
    monkeypatch.setattr("gateway.config.policy.MAX_POLICY_BYTES", len(GOOD))  # parsing 8 MiB takes 5 s
    path.write_text(GOOD)
    assert load_policy(path).models  # at the limit
    path.write_text(GOOD + "\n")
    with pytest.raises(PolicyError, match="larger than the limit"):
        load_policy(path)


def test_a_policy_file_that_is_not_utf8_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(GOOD.replace("small", "sm\xffall").encode("latin-1"))
    with pytest.raises(PolicyError, match=r"p.yaml: not UTF-8 \(byte \d+\)"):
        read_policy_text(path)
    path.write_bytes(GOOD.replace("\n", "\r\n").encode())
    assert read_policy_text(path) == GOOD  # line ends as read_text() gave them: the same version hash


@pytest.mark.parametrize("weight", [".nan", ".inf", "-.inf"])
def test_complexity_weights_must_be_finite(weight: str) -> None:
    """A NaN weight made every score 1.0: every request went to the top tier."""
    text = ROUTED.replace(
        "    fallbacks: [direct]",
        f"    fallbacks: [direct]\n    complexity_weights: {{log_tokens: {weight}}}",
    )
    with pytest.raises(
        PolicyError, match=r"routes.auto.complexity_weights.log_tokens: Input should be a finite"
    ):
        parse_policy(text)


@pytest.mark.parametrize(
    ("health", "message"),
    [
        ("health: {interval: 1.0e-9}", "health.interval: Input should be greater than or equal to 0.05"),
        ("health: {interval: .inf}", "health.interval: Input should be a finite number"),
        ("health: {interval: .nan}", "health.interval: Input should be a finite number"),
    ],
)
def test_the_health_interval_has_a_floor_and_is_finite(health: str, message: str) -> None:
    """1e-9 s between checks kept ~40% of a core busy per replica, in the gateway and the upstream."""
    with pytest.raises(PolicyError, match=re.escape(message)):
        parse_policy(GOOD + health)
    override = GOOD.replace("type: engine,", "type: engine, health: {interval: 0.001},")
    with pytest.raises(
        PolicyError, match=r"backends.local.health.interval: Input should be greater than or equal to 0.05"
    ):
        parse_policy(override)
    assert parse_policy(GOOD + "health: {interval: 0.05}").health.interval == 0.05


@pytest.mark.parametrize(
    ("setting", "where"),
    [
        ("timeouts: {first_token: .inf}", "backends.local.timeouts.first_token"),
        ("health: {breaker: {cooldown: .inf}}", "backends.local.health.breaker.cooldown"),
    ],
)
def test_no_number_in_the_policy_may_be_infinite(setting: str, where: str) -> None:
    """An infinite timeout waits forever; an infinite cooldown never lets the replica back."""
    with pytest.raises(PolicyError, match=where.replace(".", r"\.")):
        parse_policy(GOOD.replace("type: engine,", f"type: engine, {setting},"))


def test_a_pipe_is_read_by_a_command_and_refused_by_the_watcher(tmp_path: Path) -> None:
    """`gateway policy check <(envsubst < p.yaml)` reads a pipe; the watcher's read (no pipes) must
    not wait on one (a FIFO at the path held its thread and the reload lock forever)."""
    import os
    import threading

    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(GOOD,))
    writer.start()
    try:
        assert load_policy(fifo).models
    finally:
        writer.join(5)
    with pytest.raises(PolicyError, match="not a regular file"):
        read_policy_text(fifo)


def test_a_merge_still_lets_a_key_beside_it_override_the_merged_one() -> None:
    from gateway.config.strict_yaml import strict_load

    assert strict_load("b: &b {x: 1, y: 2}\nm:\n  <<: *b\n  x: 3\n")["m"] == {"x": 3, "y": 2}
