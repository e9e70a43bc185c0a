"""The benchmark's raw-asyncio fake upstream speaks the protocol the official client expects."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from itertools import pairwise

import httpx
import openai
import pytest

from tests.engine.server_proc import ManagedServer


@pytest.fixture(scope="module")
def fast() -> Iterator[ManagedServer]:
    server = ManagedServer(lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port)])
    try:
        yield server
    finally:
        server.stop()


def test_whole_and_streamed_answers_parse_with_the_official_client(fast: ManagedServer) -> None:
    client = openai.OpenAI(base_url=f"{fast.base_url}/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert whole.choices[0].message.content == "Hello from fake"
    assert whole.usage is not None and whole.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from fake"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8
    text = list(client.completions.create(model="m", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in text) == "Hello from fake"


def test_a_paced_stream_spaces_its_tokens_and_sends_usage_with_the_last() -> None:
    paced = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
                      "--gap-ms", "40", "--tokens", "3"]
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{paced.base_url}/v1", api_key="x", max_retries=0)
        arrived: list[tuple[float, openai.types.chat.ChatCompletionChunk]] = []
        started = time.perf_counter()
        for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            arrived.append((time.perf_counter() - started, chunk))
        texts = [c.choices[0].delta.content for _, c in arrived if c.choices]
        assert texts == ["", " w0", " w1", " w2"]  # the role chunk, then one word per chunk
        times = [t for t, _ in arrived]
        # three 40 ms gaps from the role chunk to the last word (a client descheduled under load can
        # read two chunks at once, so one gap may close: their sum cannot)
        assert times[3] - times[0] >= 0.1 and sum(b - a >= 0.03 for a, b in pairwise(times[:4])) >= 2
        assert arrived[-1][1].usage is not None and times[-1] - times[3] < 0.03  # with the last word
        text = list(client.completions.create(model="m", prompt="hi", stream=True))
        assert "".join(c.choices[0].text for c in text) == " w0 w1 w2"
    finally:
        paced.stop()


def test_a_held_head_leaves_with_the_first_word() -> None:
    held = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
                      "--gap-ms", "60", "--tokens", "2", "--hold-head"]
    )  # fmt: skip
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client() as client:
            started = time.perf_counter()
            with client.stream("POST", f"{held.base_url}/v1/chat/completions", json=body) as response:
                head_at = time.perf_counter() - started
                lines = [(time.perf_counter() - started, ln) for ln in response.iter_lines() if ln]
        assert response.status_code == 200
        assert head_at >= 0.05  # not before the first word, one gap after the role chunk was ready
        texts = [json.loads(ln[6:])["choices"][0]["delta"].get("content") for _, ln in lines[:-1]]
        assert texts == ["", " w0", " w1"] and lines[-1][1] == "data: [DONE]"
        assert lines[1][0] - head_at < 0.03 <= lines[2][0] - lines[1][0]  # w0 with the head, then a gap
    finally:
        held.stop()
