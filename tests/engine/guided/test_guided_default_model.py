"""Structured outputs from the default model (SmolLM2-135M-Instruct) through the `openai` client,
against the engine server and through the gateway in front of it: `beta.chat.completions.parse`
with Pydantic models, json_object, streamed json_schema, capabilities.

Strings and lists carry bounds: a 135M model may repeat itself inside a string, and a bound is what
makes the grammar end before max_tokens (the output is held to the schema either way).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from tests.engine.server_proc import ServerProcess
from tests.gateway.processes import gateway_in_front

pytestmark = pytest.mark.slow

Short = Annotated[str, Field(max_length=24)]


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    occupation: Short


class Address(BaseModel):
    street: Short
    city: Short
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Contact(BaseModel):
    name: Short
    address: Address
    phones: list[Annotated[str, Field(pattern=r"^[0-9]{3}-[0-9]{4}$")]] = Field(max_length=2)


class Recipe(BaseModel):
    title: Short
    servings: int = Field(ge=1, le=12)
    difficulty: Literal["easy", "medium", "hard"]
    ingredients: list[Short] = Field(min_length=1, max_length=3)


class Book(BaseModel):
    title: Short
    author: Short
    year: int = Field(ge=1400, le=2030)
    genres: list[Literal["fiction", "mystery", "science", "history", "poetry"]] = Field(max_length=3)


class Weather(BaseModel):
    city: Short
    temperature_c: int = Field(ge=-60, le=60)
    condition: Literal["sunny", "cloudy", "rain", "snow"]
    humidity_percent: int = Field(ge=0, le=100)


class Product(BaseModel):
    name: Short
    price: float = Field(ge=0, le=10000)
    in_stock: bool
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)


class Task(BaseModel):
    title: Short
    priority: Literal["low", "medium", "high"]
    done: bool


class TodoList(BaseModel):
    owner: Short
    tasks: list[Task] = Field(min_length=1, max_length=2)


class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    sentiment: Literal["positive", "neutral", "negative"]
    summary: Annotated[str, Field(max_length=60)]


class Planet(BaseModel):
    name: Short
    moons: int = Field(ge=0, le=300)
    has_rings: bool
    neighbours: list[Short] = Field(max_length=2)


CASES: list[tuple[str, type[BaseModel]]] = [
    ("Describe a fictional software engineer.", Person),
    ("Tell me about a retired teacher named Maria.", Person),
    ("Invent a detective for a novel.", Person),
    ("Give the contact card of a plumber in Boston.", Contact),
    ("Make up an address book entry for Ann.", Contact),
    ("A simple pancake recipe.", Recipe),
    ("A recipe for tomato soup.", Recipe),
    ("A hard dessert recipe.", Recipe),
    ("Describe a famous novel.", Book),
    ("Recommend a history book.", Book),
    ("What is the weather like in Oslo in winter?", Weather),
    ("Summer weather in Madrid.", Weather),
    ("Describe a laptop for sale.", Product),
    ("A coffee mug in an online shop.", Product),
    ("My chores for Saturday.", TodoList),
    ("A todo list for moving house.", TodoList),
    ("Review a pizza restaurant you loved.", Review),
    ("Review a boring movie.", Review),
    ("Describe Saturn.", Planet),
    ("Describe Mars.", Planet),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("default", "--max-model-len", "1024", "--no-access-log")
    try:
        yield proc
    finally:
        assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def via_gateway(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A client of the gateway, whose policy serves "default" from the engine server above."""
    root = tmp_path_factory.mktemp("gateway")
    with gateway_in_front(server.base_url, "default", root, alias="default") as (gateway, key):
        yield openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0, timeout=300)


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# greedy answers that end well inside max_tokens (any JSON object has no bound of its own)
JSON_OBJECT_PROMPTS = [
    "Reply with a JSON object with the keys name and age for Alice, who is 30.",
    "Describe a cat in JSON with keys name, color and age.",
    "Give me a JSON config for a web server with host and port.",
]


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI, via_gateway: openai.OpenAI) -> dict[str, list[Any]]:
    """Every request of this module at once: the engine runs them as one batch (about 50 rows)."""

    def parse(case: tuple[str, type[BaseModel]], through: openai.OpenAI = client) -> Any:
        prompt, model = case
        return through.beta.chat.completions.parse(
            model="default", messages=_user(prompt), response_format=model, max_tokens=250, temperature=0
        )

    def json_object(prompt: str, through: openai.OpenAI = client) -> Any:
        return through.chat.completions.create(
            model="default",
            messages=_user(prompt),
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=0,
        )

    def streamed(prompt: str) -> str:
        stream = client.chat.completions.create(
            model="default",
            messages=_user(prompt),
            response_format=type_to_response_format_param(Weather),  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            stream=True,
        )
        return "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)

    with ThreadPoolExecutor(2 * len(CASES) + 2 * len(JSON_OBJECT_PROMPTS) + 1) as pool:
        parsed = [pool.submit(parse, case) for case in CASES]
        gateway = [pool.submit(parse, case, via_gateway) for case in CASES]
        objects = [pool.submit(json_object, prompt) for prompt in JSON_OBJECT_PROMPTS]
        objects += [pool.submit(json_object, prompt, via_gateway) for prompt in JSON_OBJECT_PROMPTS]
        stream = pool.submit(streamed, "What is the weather like in Oslo in winter?")
        return {
            "parsed": [f.result() for f in parsed],
            "gateway": [f.result() for f in gateway],
            "objects": [f.result() for f in objects],
            "stream": [stream.result()],
        }


@pytest.mark.parametrize("path", ["parsed", "gateway"])
def test_parse_gives_a_parsed_object_for_every_prompt(answers: dict[str, list[Any]], path: str) -> None:
    for (prompt, model), resp in zip(CASES, answers[path], strict=True):
        message = resp.choices[0].message
        assert isinstance(message.parsed, model), (prompt, message.content)
        assert resp.choices[0].finish_reason == "stop"


def test_json_object_answers_parse_as_objects(answers: dict[str, list[Any]]) -> None:
    for resp in answers["objects"]:
        assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_a_streamed_json_schema_answer_concatenates_to_valid_json(answers: dict[str, list[Any]]) -> None:
    Weather.model_validate_json(answers["stream"][0])


def test_models_say_the_default_model_takes_json_schema(server: ServerProcess, client: openai.OpenAI) -> None:
    model = client.models.list().data[0]
    caps = (model.model_extra or {})["capabilities"]
    assert caps["json_schema"] and caps["json_object"] and caps["context_length"] == 1024
