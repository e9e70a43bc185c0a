"""`beta.chat.completions.parse` on a tiny random model (SmolLM2's tokenizer), against the engine
server and through the gateway: the grammar alone makes random logits a valid object of every
one of the 20 Pydantic models of the default-model test (whose bounds end each string and list)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.guided.test_guided_default_model import CASES
from tests.engine.server_proc import ServerProcess
from tests.gateway.processes import gateway_in_front


@pytest.fixture(scope="module")
def clients(
    tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, openai.OpenAI]]:
    engine = ServerProcess(tiny_chat_model, "--no-access-log")
    try:
        root = tmp_path_factory.mktemp("parse")
        with gateway_in_front(engine.base_url, tiny_chat_model.name, root) as (gateway, key):
            yield {
                "engine": openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="x", max_retries=0),
                "gateway": openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0),
            }
    finally:
        assert engine.stop() == 0


@pytest.mark.parametrize("path", ["engine", "gateway"])
def test_parse_gives_a_parsed_object_for_every_prompt_from_random_logits(
    clients: dict[str, openai.OpenAI], path: str
) -> None:
    client = clients[path]

    def parse(seed: int) -> Any:
        prompt, model = CASES[seed]
        return client.beta.chat.completions.parse(
            model="tiny" if path == "gateway" else "", messages=[{"role": "user", "content": prompt}],
            response_format=model, max_tokens=400, temperature=1.0, seed=seed,
        )  # fmt: skip

    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = list(pool.map(parse, range(len(CASES))))
    for (prompt, model), reply in zip(CASES, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), (
            prompt, choice.message.content,
        )  # fmt: skip
