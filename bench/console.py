"""The web console with a month of traffic: how long each page takes, measured over HTTP.

Fills a fresh PostgreSQL database with N request rows (1M) spread over the last 30 days (statuses,
failovers, 4 models, 3 backends, K keys with their api_keys rows) and the daily aggregates the log
writer keeps, starts a gateway process on it, logs in as a browser would, and times each page
(median and worst of R fetches, whole answer): the overview and its JSON, keys, spend for the month
grouped by key and by day, the request log's first page and its 20th (following the cursors),
filtered by key, by a rare status and by model, and one request's detail.

Target (issue 21): fast with a month of 1M rows: every page well under a second.

Usage: python bench/console.py [--rows 1000000] [--keys 500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import asyncpg
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.store.migrate import upgrade  # noqa: E402
from tests.gateway.processes import start_gateway  # noqa: E402

ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
MASTER = "sk-bench-master"
MODELS = ["auto", "gpt-4o-mini", "claude-haiku-4-5", "SmolLM2-135M-Instruct"]
BACKENDS = ["local", "openai", "anthropic"]
COLUMNS = ["id", "created_at", "finished_at", "key_id", "team", "requested_model", "backend", "route_tier",
           "status", "error_type", "failover", "prompt_tokens", "completion_tokens", "cached_tokens",
           "latency_ms", "overhead_ms", "attempts", "cost_picousd", "reference_cost_picousd",
           "cost_estimated"]  # fmt: skip


def _record(i: int, rng: random.Random, now: datetime, keys: list[str]) -> tuple[object, ...]:
    created = now - timedelta(seconds=rng.randrange(30 * 86400))
    backend = rng.choice(BACKENDS)
    prompt, completion = rng.randrange(10, 4000), rng.randrange(1, 800)
    status = 200 if rng.random() > 0.01 else rng.choice([429, 502, 503])  # ~1% errors, 429 rare
    failover = "local: 503 replica unavailable" if rng.random() < 0.005 else None
    key = rng.choice(keys)
    return (f"req-{i}", created, created, key, f"team{int(key[:4], 16) % 20}", rng.choice(MODELS), backend,
            "simple", status, None if status == 200 else "upstream_error", failover, prompt, completion, 0,
            Decimal(rng.randrange(200, 9000)) / 10, Decimal(rng.randrange(100, 900)) / 1000, 1,
            (prompt * 150 + completion * 600) * 1000,
            (prompt * 2500 + completion * 10000) * 1000 if backend == "local" else None, False)  # fmt: skip


async def fill(url: str, rows: int, keys: int) -> None:
    """N rows over the last 30 days, the api_keys they name, and the daily aggregates."""
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    rng, now = random.Random(0), datetime.now(UTC)
    key_ids = [uuid.uuid4().hex for _ in range(keys)]
    await conn.executemany(
        "INSERT INTO api_keys (id, key_hash, key_prefix, name, team, metadata, budget_picousd, "
        "budget_period) VALUES ($1, $2, 'sk-bench', $3, $4, '{}', $5, 'monthly')",
        [(k, uuid.uuid4().hex, f"app-{i}", f"team{int(k[:4], 16) % 20}", 50 * 10**12)
         for i, k in enumerate(key_ids)],
    )  # fmt: skip
    for offset in range(0, rows, 50_000):
        records = [_record(i, rng, now, key_ids) for i in range(offset, min(rows, offset + 50_000))]
        await conn.copy_records_to_table("request_logs", records=records, columns=COLUMNS)
    await conn.execute("""
        INSERT INTO usage_daily (day, key_id, team, requested_model, backend, requests, errors, prompt_tokens,
                                 completion_tokens, cached_tokens, cost_picousd, reference_cost_picousd,
                                 reference_basis_picousd)
        SELECT (created_at AT TIME ZONE 'UTC')::date, key_id, team, requested_model, backend, count(*),
               count(*) FILTER (WHERE status >= 400), sum(prompt_tokens), sum(completion_tokens),
               sum(cached_tokens), sum(cost_picousd), coalesce(sum(reference_cost_picousd), 0),
               coalesce(sum(cost_picousd) FILTER (WHERE reference_cost_picousd IS NOT NULL), 0)
        FROM request_logs GROUP BY 1, 2, 3, 4, 5
    """)
    await conn.execute("ANALYZE")
    aggregates = await conn.fetchval("SELECT count(*) FROM usage_daily")
    print(f"filled {rows:,} request rows over 30 days, {keys} keys, {aggregates:,} daily aggregate rows")
    await conn.close()


def timed(client: httpx.Client, path: str, repeats: int) -> tuple[float, float, str]:
    """(median ms, worst ms, the last answer's text) of GET `path`."""
    samples, text = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        answer = client.get(path, headers={"accept": "text/html"})
        samples.append((time.perf_counter() - start) * 1e3)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
        text = answer.text
    return statistics.median(samples), max(samples), text


def measure(base_url: str, repeats: int) -> None:
    with httpx.Client(base_url=base_url, timeout=120, follow_redirects=True) as client:
        login = client.post("/ui/login", data={"master_key": MASTER})
        assert login.status_code == 200 and "Overview" in login.text
        today = datetime.now(UTC).date()
        month = f"from={today - timedelta(days=29)}&to={today}"
        pages = [("overview", "/ui"), ("overview JSON (what the page polls)", "/ui/api/overview"),
                 ("keys (500, with spend against budget)", "/ui/keys"),
                 ("spend, 30 days by key", f"/ui/spend?{month}&by=key"),
                 ("spend, 30 days by day", f"/ui/spend?{month}&by=day"),
                 ("spend CSV, 30 days by team", f"/ui/spend?{month}&by=team&format=csv"),
                 ("requests, first page", "/ui/requests")]  # fmt: skip
        print(f"{'page':<44} {'median ms':>10} {'worst ms':>9}")
        texts = {}
        for name, path in pages:
            median, worst, texts[name] = timed(client, path, repeats)
            print(f"{name:<44} {median:10.1f} {worst:9.1f}")
        path, seen = "/ui/requests", 0
        start = time.perf_counter()
        for _ in range(19):
            found = re.search(r'<a href="([^"]+)" rel="next">', client.get(path).text)
            assert found is not None
            path, seen = found.group(1).replace("&amp;", "&"), seen + 1
        walk = (time.perf_counter() - start) * 1e3 / seen
        median, worst, text = timed(client, path, repeats)
        label = "requests, 20th page (by cursor)"
        print(f"{label:<44} {median:10.1f} {worst:9.1f}   (each of pages 1-19: {walk:.1f} ms)")
        key = re.search(r"<td>([0-9a-f]{32})</td>", texts["requests, first page"])
        rid = re.search(r'href="/ui/requests/(req-\d+)"', text)
        assert key is not None and rid is not None
        for name, path in (("requests of one key", f"/ui/requests?key={key.group(1)}"),
                           ("requests with status 429 (rare)", "/ui/requests?status=429"),
                           ("requests of one model", "/ui/requests?model=gpt-4o-mini"),
                           ("one request's detail", f"/ui/requests/{rid.group(1)}")):  # fmt: skip
            median, worst, _ = timed(client, path, repeats)
            print(f"{name:<44} {median:10.1f} {worst:9.1f}")


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    name = f"gw_console_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    try:
        await asyncio.to_thread(upgrade, url)
        start = time.perf_counter()
        await fill(url, args.rows, args.keys)
        print(f"(fill took {time.perf_counter() - start:.0f} s)")
        env = {"GATEWAY_MASTER_KEY": MASTER, "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": url}
        server = start_gateway(ROOT / "policies" / "default.yaml", env)
        try:
            await asyncio.to_thread(measure, server.base_url, args.repeats)
        finally:
            server.stop()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
