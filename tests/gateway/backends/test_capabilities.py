"""What backends say their models can do: an engine's /v1/models cards (a real fake engine over
HTTP), merged over replicas; a hosted model from litellm's bundled map."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.backends.base import Learned
from gateway.backends.engine import EnginePool
from gateway.backends.hosted import HostedModel
from gateway.backends.litellm_map import learned_from_litellm
from gateway.backends.model_cards import merge_replicas, parse_model_cards
from gateway.config.policy import Capabilities, EngineBackend, HealthSettings, HostedBackend, parse_policy
from gateway.routing.capabilities import CapabilityTable
from tests.engine.server_proc import ManagedServer

CARD = {"max_model_len": 4096, "capabilities": {"tools": False, "json_schema": True, "vision": False}}


@pytest.fixture(scope="module")
def engine() -> Iterator[ManagedServer]:
    server = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)], 60
    )
    try:
        yield server
    finally:
        server.stop()


def _listing(*cards: dict[str, object]) -> bytes:
    return orjson.dumps({"object": "list", "data": list(cards)})


def test_a_card_gives_the_context_and_the_capabilities_it_states() -> None:
    cards = parse_model_cards(_listing({"id": "m", **CARD}, {"id": "bare"}))
    assert cards == {
        "m": Learned(Capabilities(tools=False, json_schema=True, vision=False), 4096),
        "bare": Learned(),  # an engine that does not report capabilities says nothing
    }


def test_the_switchboard_engines_own_card_is_understood() -> None:
    # the shape engine/model_info.py's ModelInfo.capabilities() gives GET /v1/models
    said = {"json_schema": True, "json_object": True, "structured_outputs": True, "tools": False,
            "vision": False, "logprobs": True, "context_length": 8192}  # fmt: skip
    card = {"id": "SmolLM2-135M-Instruct", "object": "model", "max_model_len": None, "capabilities": said}
    assert parse_model_cards(_listing(card)) == {
        "SmolLM2-135M-Instruct": Learned(
            Capabilities(tools=False, json_schema=True, json_object=True, vision=False, logprobs=True), 8192
        )
    }


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"data": {}}', b'{"object": "list"}'])
def test_an_answer_that_is_not_a_model_list_reports_nothing(raw: bytes) -> None:
    assert parse_model_cards(raw) is None


def test_values_of_the_wrong_type_count_as_unsaid_never_as_true() -> None:
    odd = {
        "id": "m",
        "max_model_len": "8192",
        "capabilities": {"tools": "yes", "vision": 1, "logprobs": True},
    }
    assert parse_model_cards(_listing(odd, {"id": 7}, {"id": "neg", "max_model_len": -1})) == {
        "m": Learned(Capabilities(logprobs=True), None),
        "neg": Learned(),
    }
    assert parse_model_cards(_listing({"id": "t", "max_model_len": True})) == {"t": Learned()}


def test_replicas_that_disagree_are_read_conservatively() -> None:
    old = {"m": Learned(Capabilities(tools=False, logprobs=True), 8192)}
    new = {"m": Learned(Capabilities(tools=True, json_schema=True), 4096), "n": Learned()}
    merged = merge_replicas([old, new])
    assert merged["m"] == Learned(Capabilities(tools=False, json_schema=True, logprobs=True), 4096)
    assert merged["n"] == Learned()


def test_an_engine_pool_learns_its_models_cards_from_the_engines_v1_models(engine: ManagedServer) -> None:
    httpx.post(f"{engine.base_url}/control", json={"card": CARD}).raise_for_status()
    spec = EngineBackend(type="engine", urls=[engine.base_url])
    policy = parse_policy(f"""
backends:
  local: {{type: engine, urls: ["{engine.base_url}"]}}
models:
  small: {{backend: local, model: fake-model, capabilities: {{json_schema: false}}}}
""")  # fmt: skip

    async def run() -> None:
        pool = EnginePool(
            "local", spec, HealthSettings(interval=60)
        )  # one round at start, then the test drives
        table = CapabilityTable(policy, {"local": pool})
        assert table.of("small").sources["tools"] == "unknown"  # nothing learned before the first check
        await pool.start()
        try:
            for _ in range(200):
                if pool.learned_version:
                    break
                await asyncio.sleep(0.02)
            assert pool.learned("fake-model") == Learned(Capabilities(**CARD["capabilities"]), 4096)  # type: ignore[arg-type]
            small = table.of("small")
            assert small.supports["tools"] is False and small.sources["tools"] == "learned"
            assert small.supports["json_schema"] is False and small.sources["json_schema"] == "declared"
            assert small.context_length == 4096 and small.sources["context_length"] == "learned"
            # a restarted engine may serve another model: a replica that comes back up is asked again
            httpx.post(
                f"{engine.base_url}/control", json={"card": {"max_model_len": 2048}}
            ).raise_for_status()
            version = pool.learned_version
            await pool._checker.check(pool.replicas[0])  # up and already learned: not asked again
            assert pool.learned_version == version
            pool.replicas[0].check_ok = False  # as a failed check leaves it
            await pool._checker.check(pool.replicas[0])
            assert pool.learned_version == version + 1 and table.of("small").context_length == 2048
            assert table.of("small").supports["tools"] is None
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_hosted_model_learns_from_litellms_bundled_map() -> None:
    mini = learned_from_litellm("openai/gpt-4o-mini")
    assert mini.capabilities == Capabilities(
        tools=True, json_schema=True, json_object=True, vision=True, logprobs=True
    )
    assert mini.context_length is not None and mini.context_length >= 128_000
    claude = learned_from_litellm("anthropic/claude-haiku-4-5")
    assert claude.capabilities.tools is True and claude.capabilities.logprobs is False  # Anthropic has none
    unknown = learned_from_litellm("openai/no-such-model")
    assert unknown.capabilities.tools is None and unknown.context_length is None  # unsaid: assumed
    model = HostedModel("frontier", HostedBackend(type="hosted", model="openai/gpt-4o-mini"))
    assert model.learned("openai/gpt-4o-mini") == mini and model.learned_version == 0
