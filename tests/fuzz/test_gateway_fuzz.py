"""A bounded, seeded fuzz run of the gateway (subprocess, SQLite) in front of the hostile upstream.

SWITCHBOARD_FUZZ_CASES (default 300) requests from SWITCHBOARD_FUZZ_SEED (default 14), 16 at a
time: malformed JSON, wrong types for every field, huge and deeply nested bodies, NUL and lone
surrogates in strings and odd header bytes, every upstream misbehaviour, client cuts mid-body,
while waiting and mid-stream. Asserted: no 5xx but 502/503/504, every error in OpenAI's format,
no stream cut without an error event, exactly one log row per request that reached the proxy,
no reservation left behind (a key with a small budget still answers), gateway RSS growth under
200 MiB, and a normal request answered at the end. A failure names the seed and the cases.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.fuzz.answers import Answer, problems, row_problems
from tests.fuzz.cases import MAX_BODY, Case, generate
from tests.fuzz.client import chat, post
from tests.fuzz.raw_client import send
from tests.fuzz.stack import MASTER, HostileStack

SEED = int(os.environ.get("SWITCHBOARD_FUZZ_SEED", "14"))
CASES = int(os.environ.get("SWITCHBOARD_FUZZ_CASES", "300"))
CONCURRENCY = 16
# Memory is bounded by the limits, not by the run's length: at most CONCURRENCY bodies of MAX_BODY
# are held at once, each as bytes and as parsed JSON (~2x); the allocator keeps that high-water
# mark. Seen: +63 to +179 MiB.
RSS_GROWTH_KIB = (CONCURRENCY * 2 * MAX_BODY + (64 << 20)) >> 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    s = HostileStack(tmp_path_factory.mktemp("fuzz"))
    try:
        yield s
    finally:
        assert s.close() == 0, "the gateway did not exit cleanly after the fuzz run"


def _run(stack: HostileStack, cases: list[Case], keys: dict[str, str | None]) -> list[Answer]:
    url = urlsplit(stack.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run() -> list[Answer]:
        async with httpx.AsyncClient(base_url=stack.upstream.base_url, timeout=10) as fake:

            async def saw(token: str) -> bool:
                return bool((await fake.get(f"/seen/{token}")).json()["seen"])

            async def one(case: Case) -> Answer:
                async with gate:
                    return await send(host, port, case, keys[case.key], saw)

            return await asyncio.gather(*(one(c) for c in cases))

    return asyncio.run(run())


def test_fuzzed_requests_keep_the_contract(stack: HostileStack) -> None:
    wide = stack.create_key(name="fuzz-wide")
    tight = stack.create_key(name="fuzz-tight", budget_usd=0.05, tpm_limit=200_000)
    key_ids = {k["name"]: k["id"] for k in _keys(stack) if k["name"] in ("fuzz-wide", "fuzz-tight")}
    keys: dict[str, str | None] = {"wide": wide, "tight": tight, "invalid": "sk-not-a-real-key", "none": None}
    cases = generate(SEED, CASES)
    rss_before = stack.rss_kib()
    started = time.monotonic()
    answers = _run(stack, cases, keys)
    elapsed = time.monotonic() - started
    rss_after = stack.rss_kib()

    failures = []
    for case, answer in zip(cases, answers, strict=True):
        if case.cut != "none":
            continue  # nobody is left to read the answer
        found = problems(answer)
        if case.reaches_proxy and answer.status is not None and answer.request_id is None:
            found.append("an answer from the proxy without x-request-id")
        if found:
            failures.append(f"{case.kind} ({case.token}, key {case.key}): {found}")

    expected = sum(c.reaches_proxy for c in cases)
    rows = _rows_of(stack, set(key_ids.values()), expected)
    failures += [
        f"row {r['id']} ({r['requested_model']!r}): {row_problems(r)}" for r in rows if row_problems(r)
    ]
    if len(rows) != expected:
        failures.append(f"{len(rows)} log rows for {expected} requests that reached the proxy")
    ids = [r["id"] for r in rows]
    if len(ids) != len(set(ids)):
        failures.append("a request was logged twice")

    normal = asyncio.run(_ask(stack, tight, chat("eng", "mode=ok after the fuzz run", max_tokens=20)))
    if normal.status != 200:
        failures.append(
            f"the small-budget key is refused after the run (reservations kept?): {normal.body!r}"
        )
    hosted = asyncio.run(_ask(stack, wide, chat("host", "mode=ok after the fuzz run", True)))
    if hosted.status != 200 or problems(hosted):
        failures.append(f"a normal hosted stream after the run: {hosted.status} {hosted.body[-200:]!r}")
    if rss_after - rss_before > RSS_GROWTH_KIB:
        failures.append(f"gateway RSS grew {(rss_after - rss_before) >> 10} MiB")

    kinds = Counter(c.kind.split(":")[0] for c in cases)
    statuses = Counter(a.status for a in answers)
    summary = (f"seed {SEED}, {len(cases)} cases in {elapsed:.1f}s; kinds {dict(kinds)}; "
               f"statuses {dict(statuses)}; rss {rss_before >> 10} -> {rss_after >> 10} MiB")  # fmt: skip
    print(summary)
    assert failures == [], summary + "\n" + "\n".join(failures)


async def _ask(stack: HostileStack, key: str, body: dict[str, object]) -> Answer:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        return await post(client, "/v1/chat/completions", key, body)


def _keys(stack: HostileStack) -> list[dict[str, str]]:
    r = httpx.get(f"{stack.url}/admin/keys", headers={"Authorization": f"Bearer {MASTER}"})
    r.raise_for_status()
    return list(r.json()["data"])


def _rows_of(stack: HostileStack, key_ids: set[str], expected: int) -> list[dict[str, object]]:
    """The fuzz keys' rows once `expected` are in, read again a second later (a late extra row
    shows); after 30 s, whatever is there (the count then tells the story)."""
    deadline = time.monotonic() + 30
    while len(rows := [r for r in stack.log_rows() if r["key_id"] in key_ids]) < expected:
        if time.monotonic() > deadline:
            return rows
        time.sleep(0.3)
    time.sleep(1.0)
    return [r for r in stack.log_rows() if r["key_id"] in key_ids]
