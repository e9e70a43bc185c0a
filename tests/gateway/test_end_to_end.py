"""Once end to end: the openai client -> gateway -> the real engine server on a tiny model."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.engine.server_proc import ServerProcess
from tests.gateway.processes import create_key_cli, start_gateway


def test_gateway_serves_the_engine_whole_and_streamed(tiny_chat_model: Path, tmp_path: Path) -> None:
    engine = ServerProcess(tiny_chat_model, "--kv-cache-memory", str(32 << 20), "--no-access-log")
    gateway = None
    try:
        model = tiny_chat_model.name
        policy = tmp_path / "policy.yaml"
        policy.write_text(f'backends:\n  local: {{type: engine, urls: ["{engine.base_url}"]}}\n'
                          f"models:\n  tiny: {{backend: local, model: {model}}}\n")  # fmt: skip
        env = {
            "GATEWAY_MASTER_KEY": "m",
            "GATEWAY_KEY_SECRET": "s",
            "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
        }
        gateway = start_gateway(policy, env)
        plaintext = create_key_cli(env, "e2e")
        direct = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="x", max_retries=0)
        through = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=plaintext, max_retries=0)
        messages = [{"role": "user", "content": "Hello through the gateway"}]
        want = direct.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        got = through.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
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
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        engine.stop()
