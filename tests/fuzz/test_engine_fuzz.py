"""A bounded, seeded fuzz run of the engine's HTTP server (tiny random model, SmolLM2's tokenizer).

SWITCHBOARD_ENGINE_FUZZ_CASES (default 400) bodies from SWITCHBOARD_ENGINE_FUZZ_SEED (default 8:
its run holds a schema that outgrows llguidance's parser rows mid-answer), 8 at a time
(tests/fuzz/engine_cases.py). Asserted: no 5xx, every error in OpenAI's format, every 200 stream
ends with `[DONE]` or an error event, no traceback in the server's log, and a normal
request answered at the end. A failure names the seed and the first bodies that broke the rules.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.server_proc import ServerProcess
from tests.fuzz.engine_cases import engine_cases

SEED = int(os.environ.get("SWITCHBOARD_ENGINE_FUZZ_SEED", "8"))
CASES = int(os.environ.get("SWITCHBOARD_ENGINE_FUZZ_CASES", "400"))
CLIENTS = 8


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_chat_model, "--max-model-len", "512", "--kv-cache-memory", str(64 << 20))
    try:
        yield proc
    finally:
        proc.stop()


def _problem(answer: httpx.Response) -> str | None:
    status = answer.status_code
    if status >= 500:
        return f"status {status}"
    if status != 200:
        try:
            error = answer.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an OpenAI error body"
        if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
            return f"{status} with an error that lacks OpenAI's fields"
        return None
    text = answer.text
    streamed = answer.headers.get("content-type", "").startswith("text/event-stream")
    if streamed and "data: [DONE]" not in text and '"error"' not in text:
        return "a stream that ends without [DONE] or an error event"
    return None


def test_hostile_bodies_get_clear_answers_and_the_engine_goes_on(server: ServerProcess) -> None:
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    cases = engine_cases(SEED, CASES, model)
    problems: list[str] = []
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def client(first: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            for path, raw in cases[first::CLIENTS]:
                answer = http.post(path, content=raw, headers={"content-type": "application/json"})
                problem = _problem(answer)
                with lock:
                    statuses[answer.status_code] += 1
                    if problem:
                        problems.append(f"{problem}: {path} {raw[:300]!r} -> {answer.text[:200]!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    after = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    if after.status_code != 200:
        problems.append(f"a normal request after the run: {after.status_code} {after.text[:200]!r}")
    if "Traceback" in server.output():
        problems.append("a traceback in the server's log:\n" + server.output()[-3000:])
    summary = f"seed {SEED}, {len(cases)} cases; statuses {dict(sorted(statuses.items()))}"
    assert statuses[200] > len(cases) // 20, summary  # the run reaches generation, not only validation
    assert problems == [], summary + "\n" + "\n".join(problems[:10])
