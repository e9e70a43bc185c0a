"""Once end to end: the openai client -> gateway -> the real engine server on a tiny model."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import openai

from tests.engine.server_proc import ManagedServer, ServerProcess
from tests.gateway.pipeline.test_failover import Load
from tests.gateway.processes import create_key_cli, gateway_in_front, start_gateway


def _image_refused(client: openai.OpenAI) -> openai.BadRequestError | None:
    """The 400 a request with an image part gets, or None when it was served."""
    parts: Any = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    try:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4
        )
    except openai.BadRequestError as exc:
        return exc
    return None


def test_gateway_serves_the_engine_whole_and_streamed(tiny_chat_model: Path, tmp_path: Path) -> None:
    engine = ServerProcess(tiny_chat_model, "--kv-cache-memory", str(32 << 20), "--no-access-log")
    model = tiny_chat_model.name
    try:
        with gateway_in_front(engine.base_url, model, tmp_path) as (gateway, plaintext):
            direct = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="x", max_retries=0)
            through = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=plaintext, max_retries=0)
            messages = [{"role": "user", "content": "Hello through the gateway"}]
            want = direct.chat.completions.create(
                model=model, messages=messages, max_tokens=12, temperature=0
            )  # type: ignore[arg-type]
            got = through.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0
            )  # type: ignore[arg-type]
            assert got.choices[0].message.content == want.choices[0].message.content
            assert got.usage is not None and want.usage is not None
            assert got.usage.completion_tokens == want.usage.completion_tokens
            chunks = list(
                through.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=12,
                    temperature=0,
                    stream=True,  # type: ignore[arg-type]
                )
            )
            assert (
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                == want.choices[0].message.content
            )
            # tool calls and structured outputs pass through the gateway as the engine gives them
            tools: Any = [{"type": "function", "function": {"name": "set_unit", "parameters": {
                "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                "additionalProperties": False}}}]  # fmt: skip
            ask: Any = {"messages": messages, "tools": tools, "tool_choice": "required",
                        "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}  # fmt: skip
            want_call = direct.chat.completions.create(model=model, **ask).choices[0]
            got_call = through.chat.completions.create(model="tiny", **ask).choices[0]
            assert got_call.finish_reason == want_call.finish_reason == "tool_calls"
            assert got_call.message.tool_calls and want_call.message.tool_calls
            assert [(c.function.name, c.function.arguments) for c in got_call.message.tool_calls] == [
                (c.function.name, c.function.arguments) for c in want_call.message.tool_calls
            ]
            arguments, finish = "", None
            for chunk in through.chat.completions.create(model="tiny", stream=True, **ask):
                for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    arguments += (piece.function.arguments or "") if piece.function else ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            assert finish == "tool_calls" and arguments == want_call.message.tool_calls[0].function.arguments
            schema: Any = {
                "type": "json_schema",
                "json_schema": {"name": "u", "schema": tools[0]["function"]["parameters"]},
            }
            shaped = through.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=80,
                temperature=0,
                response_format=schema,  # type: ignore[arg-type]
            )
            assert json.loads(shaped.choices[0].message.content or "")["unit"] in ("c", "f")
            # the gateway learned the engine's card (GET /v1/models: no vision): an image never reaches it
            deadline = time.monotonic() + 10
            refused = _image_refused(through)
            while refused is None or refused.code != "model_capability_missing":
                assert time.monotonic() < deadline, f"the gateway never learned the engine's card: {refused}"
                time.sleep(0.2)
                refused = _image_refused(through)
            assert refused.param == "messages"
            assert refused.response.headers["x-gateway-failover"] == "tiny=lacks_vision"
    finally:
        engine.stop()


def test_killing_the_engine_under_load_fails_over_to_the_hosted_fake_without_a_failed_request(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    engine = ServerProcess(tiny_chat_model, "--kv-cache-memory", str(32 << 20), "--no-access-log")
    hosted = ManagedServer(lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60)
    gateway = None
    try:
        policy = tmp_path / "policy.yaml"
        policy.write_text(f"""
backends:
  local: {{type: engine, urls: ["{engine.base_url}"], timeouts: {{connect: 1, first_token: 5, total: 30}}}}
  frontier: {{type: hosted, model: openai/fake-model, api_key_env: FAKE_PROVIDER_KEY,
             base_url: "{hosted.base_url}/v1"}}
models:
  tiny: {{backend: local, model: {tiny_chat_model.name}, fallbacks: [hosted]}}
  hosted: {{backend: frontier}}
health: {{interval: 0.2, timeout: 0.5}}
""")  # fmt: skip
        env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "FAKE_PROVIDER_KEY": "sk-fake",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"}  # fmt: skip
        gateway = start_gateway(policy, env)
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "keep going"}]}
        with Load(f"{gateway.base_url}/v1/chat/completions", create_key_cli(env, "e2e"), 3, body) as load:
            deadline = time.monotonic() + 30
            while not any(a.backend == "local" for a in load.answers):  # the engine serves the load
                assert time.monotonic() < deadline and not load.errors, load.errors[:3]
                time.sleep(0.1)
            killed = time.monotonic()
            engine.proc.send_signal(signal.SIGKILL)
            engine.proc.wait()
            time.sleep(3.0)
            after = load.since(killed + 2.0)
        assert not load.errors, load.errors[:3]
        assert after and all(a.backend == "frontier" for a in after)
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        if engine.proc.poll() is None:
            engine.stop()
        hosted.stop()
