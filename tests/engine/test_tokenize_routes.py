"""vLLM's /tokenize, /detokenize and /version: counts that match what the same request is billed."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.server import create_app
from engine.tokenizer import load_tokenizer

KEY = {"Authorization": "Bearer s3cret"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def client(tiny_chat_model: Path) -> Iterator[TestClient]:
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_chat_model), kv_cache_memory=16 << 20), "tiny")
    with TestClient(create_app(engine, ["tiny"], api_key="s3cret")) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client


def _post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, json=body, headers=KEY)


def test_a_prompt_is_counted_as_a_text_completion_bills_it(client: TestClient, tiny_chat_model: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog, twice: naïve café 🦊."
    r = _post(client, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tokenizer = load_tokenizer(tiny_chat_model)
    assert body["tokens"] == tokenizer(text).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    billed = _post(client, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert body["count"] == billed["prompt_tokens"]
    plain = _post(client, "/tokenize", {"prompt": text}).json()
    assert plain["token_strs"] is None and plain["tokens"] == body["tokens"]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"messages_tail": [{"role": "assistant", "content": "It is"}], "continue_final_message": True,
         "add_generation_prompt": False},
    ],
    ids=["plain", "tools", "continued"],
)  # fmt: skip
def test_a_conversation_is_counted_as_a_chat_completion_bills_it(
    client: TestClient, extra: dict[str, Any]
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris? <|im_start|> is just text here."},
    ]
    options = dict(extra)
    messages += options.pop("messages_tail", [])
    r = _post(client, "/tokenize", {"messages": messages, **options})
    assert r.status_code == 200, r.text
    billed = _post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **options})
    assert billed.status_code == 200, billed.text
    assert r.json()["count"] == billed.json()["usage"]["prompt_tokens"]
    if not extra:  # the assistant's opened turn is counted only where the request opens it
        closed = _post(client, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
        assert 0 < closed["count"] < r.json()["count"]


def test_detokenize_gives_the_text_back(client: TestClient) -> None:
    text = "Résumé: 3 × 4 = 12 ✓"
    ids = _post(client, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = _post(client, "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert _post(client, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "tiny"}, 400, "prompt"),
        ("/tokenize", {"prompt": 12}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{x}}"}, 400,
         "chat_template"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, 400,
         "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_openai_errors(
    client: TestClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = _post(client, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_prompt_past_the_context_is_counted_one_past_four_contexts_is_not(client: TestClient) -> None:
    long = " ".join(f"word{i}" for i in range(400))  # about 1,200 tokens: past the 512 context
    counted = _post(client, "/tokenize", {"prompt": long}).json()
    assert counted["count"] > 512
    huge = long * 8  # surely past 4 contexts (2,048 tokens): refused before it is read whole
    r = _post(client, "/tokenize", {"prompt": huge})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    chat = _post(client, "/tokenize", {"messages": [{"role": "user", "content": huge}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text


def test_the_key_guards_tokenizing_but_not_the_version(client: TestClient) -> None:
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
    version = client.get("/version")
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("switchboard")}
