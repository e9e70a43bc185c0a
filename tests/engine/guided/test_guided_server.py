"""Guided decoding through the engine server and the official `openai` client, on a tiny random model
with SmolLM2's tokenizer: response_format and structured_outputs on both routes, streams, n > 1,
batch invariance and recompute preemption, 400s that name the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine.models.config import ModelConfig
from tests.engine.server_proc import ServerProcess

# every string and array bounded, so that random logits reach the end of the grammar
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 10000000},
        "kind": {"enum": ["village", "town", "city"]},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city", "population", "kind", "districts"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "town", "schema": SCHEMA, "strict": True},
}
# a $ref cycle under required properties: no finite instance
REQUIRED_CYCLE: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/node"}},
    "required": ["a"],
    "$defs": {
        "node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
    },
}
POOL_BLOCKS = 24  # one request (~40 prompt + 120 output tokens: 10 blocks) fits; eight at once do not


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    cfg = ModelConfig.from_dir(tiny_chat_model)
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    proc = ServerProcess(
        tiny_chat_model, "--kv-cache-memory", str(POOL_BLOCKS * block_bytes), "--no-access-log"
    )
    try:
        yield proc
    finally:
        assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, text: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 1.0)
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": text}], **kwargs)


def test_models_report_structured_output_capabilities(server: ServerProcess) -> None:
    entry = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
    caps = entry["capabilities"]
    assert caps["json_schema"] and caps["json_object"] and caps["structured_outputs"]
    assert caps["tools"] is True and caps["context_length"] == entry["max_model_len"]


def test_json_schema_output_is_valid_whole_and_streamed_alike(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(response_format=RESPONSE_FORMAT, seed=21)
    whole = _chat(client, "Describe a town.", **kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    pieces = [
        c.delta.content or ""
        for chunk in _chat(client, "Describe a town.", stream=True, **kwargs)
        for c in chunk.choices
    ]
    assert len(pieces) > 3 and "".join(pieces) == whole.message.content


def test_each_of_n_choices_follows_the_schema(client: openai.OpenAI) -> None:
    resp = _chat(client, "Three towns, please.", response_format=RESPONSE_FORMAT, n=3, seed=5)
    values = [json.loads(c.message.content) for c in resp.choices]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 1


def test_structured_outputs_work_on_chat_and_text_completions(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    chat = _chat(client, "A colour?", seed=1, extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices
    pattern = r"\d{3}-\d{4}"
    text = client.completions.create(
        model="",
        prompt="Phone: ",
        max_tokens=20,
        seed=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, text.choices[0].text) and text.choices[0].finish_reason == "stop"
    legacy = client.completions.create(
        model="", prompt="JSON:", max_tokens=120, seed=3, extra_body={"response_format": RESPONSE_FORMAT}
    )
    jsonschema.validate(json.loads(legacy.choices[0].text), SCHEMA)


def test_a_seeded_guided_answer_is_the_same_alone_in_a_crowd_and_after_preemption(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    kwargs: dict[str, Any] = dict(response_format=RESPONSE_FORMAT, seed=77, logprobs=True, top_logprobs=2)
    alone = _chat(client, "Describe a city.", **kwargs).choices[0]
    before = server.metrics()["engine:num_preemptions_total"]

    def crowd(i: int) -> Any:
        if i == 3:
            return _chat(client, "Describe a city.", **kwargs).choices[0]
        if i % 2:
            return _chat(client, f"Talk {i}", max_tokens=100, extra_body={"ignore_eos": True})
        rf = {"type": "json_schema", "json_schema": {"name": f"t{i}", "schema": SCHEMA}}
        return _chat(client, f"Town {i}", response_format=rf, extra_body={"min_tokens": 5})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(crowd, range(8)))
    assert server.metrics()["engine:num_preemptions_total"] > before, "the small pool should preempt"
    mixed = results[3]
    assert mixed.message.content == alone.message.content
    assert mixed.logprobs.content == alone.logprobs.content  # bit for bit, top-2 included


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
            "invalid_json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}},
            "response_format.json_schema.schema",
            "invalid_json_schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        (  # every answer would nest forever: refused up front, not after the stream has started
            {"structured_outputs": {"json": REQUIRED_CYCLE, "disable_any_whitespace": True}},
            "structured_outputs.json",
            "invalid_json_schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "invalid_grammar"),
        (
            {"structured_outputs": {"grammar": "start: nothing"}},
            "structured_outputs.grammar",
            "invalid_grammar",
        ),
        ({"structured_outputs": {"guided_json": {}}}, "structured_outputs.guided_json", "invalid_value"),
        ({"guided_regex": "[0-9]+"}, "guided_regex", "invalid_value"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "invalid_value",
        ),
        (
            {"structured_outputs": {"choice": [str(i) for i in range(300)]}},
            "structured_outputs.choice",
            "limit_exceeded",
        ),
        ({"structured_outputs": {"regex": "a" * 5000}}, "structured_outputs.regex", "limit_exceeded"),
        (
            {"structured_outputs": {"json": {"enum": ["x" * 70000]}}},
            "structured_outputs.json",
            "limit_exceeded",
        ),
    ],
)
def test_a_constraint_that_cannot_be_used_is_a_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "hi", max_tokens=5, extra_body=body)
    exc = info.value
    assert exc.status_code == 400 and exc.type == "invalid_request_error"
    assert (exc.param, exc.code) == (param, code)
    with pytest.raises(openai.BadRequestError) as text_info:
        client.completions.create(model="", prompt="hi", max_tokens=5, extra_body=body)
    assert (text_info.value.param, text_info.value.code) == (param, code)


def test_a_schema_with_no_finite_instance_is_refused_before_a_stream_starts(server: ServerProcess) -> None:
    """Before the check, the stream began (200, a role chunk) and then carried an error event once
    the grammar's forced tokens passed the parser's limits."""
    body = {
        "model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
        "structured_outputs": {"json": REQUIRED_CYCLE, "disable_any_whitespace": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        r.read()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("structured_outputs.json", "invalid_json_schema")
    assert "no finite instance" in error["message"]


def test_a_grammar_that_breaks_mid_answer_fails_its_request_alone(server: ServerProcess) -> None:
    """A schema too wide for llguidance's parser limits lets its mask allow a token that consuming
    then refuses, on some sampled paths: that request gets a 400 (whole) or an error event
    (streamed) naming the field; the plain requests in the same steps are answered."""
    wide = {"anyOf": [{"type": "object"}] * 500}
    url = f"{server.base_url}/v1/chat/completions"
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]

    def post(seed: int, stream: bool, guided: bool) -> httpx.Response:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hello"}],
                                "max_tokens": 8, "seed": seed, "stream": stream}  # fmt: skip
        if guided:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}
        return httpx.post(url, json=body, timeout=120)

    jobs = [
        (seed, stream, guided) for seed in range(12) for stream in (False, True) for guided in (True, False)
    ]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: post(*job), jobs))
    broken = 0
    for (_, stream, guided), answer in zip(jobs, answers, strict=True):
        if not guided:
            assert answer.status_code == 200 and ("data: [DONE]" in answer.text if stream else True)
            continue
        if stream:
            assert answer.status_code == 200
            if "data: [DONE]" in answer.text:
                continue
            events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
            error = events[-1]["error"]
        elif answer.status_code == 200:
            continue
        else:
            assert answer.status_code == 400
            error = answer.json()["error"]
        broken += 1
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json_schema"
        assert error["param"] == "response_format.json_schema.schema" and "too complex" in error["message"]
    assert broken > 0
    assert post(0, False, False).status_code == 200  # and the server goes on
