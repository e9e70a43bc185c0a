"""Speculative decoding through the HTTP server: announced in /v1/models, streamed output equal to
the whole answer's and to an opted-out request's, and vLLM-named counters in /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.server import create_app

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def client(tiny_chat_model: Path) -> Iterator[TestClient]:
    # a tiny random model with SmolLM2's tokenizer: outputs have text, so stop strings apply
    config = EngineConfig(model=str(tiny_chat_model), kv_cache_memory=16 << 20, speculative_config=SPEC)
    app = create_app(AsyncLLMEngine(config, "tiny"), ["tiny"])
    with TestClient(app) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield c


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_announce_speculation_and_outputs_match_streamed_whole_and_opted_out(
    client: TestClient,
) -> None:
    entry = client.get("/v1/models").json()["data"][0]
    assert entry["speculative_decoding"]["method"] == "ngram"
    assert entry["speculative_decoding"]["num_speculative_tokens"] == 3
    prompt = [1000, 2000, 3000, 4000, 5000] * 6 + [1000, 2000]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    text = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 40 and len(text) > 20
    opted_out = client.post("/v1/completions", json={**body, "speculative": False}).json()
    assert opted_out["choices"][0]["text"] == text
    streamed = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                streamed += choices[0]["text"] if choices else ""
    assert streamed == text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string the answer reaches mid-way
    for speculative in (True, False):
        cut = client.post("/v1/completions", json={**body, "stop": [stop], "speculative": speculative}).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["choices"][0]["text"] == text[: text.index(stop)]
    metrics = client.get("/metrics").text
    drafted = _metric(metrics, "engine:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "engine:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert _metric(metrics, "engine:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_a_non_boolean_opt_out_is_a_400(client: TestClient) -> None:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "speculative": "sometimes"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
