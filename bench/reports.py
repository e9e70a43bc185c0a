"""Finance reports and budget/rate-limit enforcement, measured.

1. Fills a fresh PostgreSQL database with N synthetic request rows over one month (COPY) and
   their daily aggregates (the rows the log writer maintains), then times a month's report by
   model and by key from the aggregates, side by side with the same report computed by scanning
   the raw log.
2. Times the request-path cost of enforcement: rate limits (RPM + TPM for key and team) and
   budgets (key + team reservation, then settlement), in-process and with Redis on loopback.

Targets (issue "Per-token cost tracking..."): report < 1 s; enforcement < 0.5 ms per request with
Redis on loopback.

Usage: python bench/reports.py [--rows 1000000] [--keys 500] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.governance.budgets import Budget, Charge, LocalBudgetStore, RedisBudgetStore  # noqa: E402
from gateway.governance.ratelimit import Limit, LocalRateLimiter, RedisRateLimiter  # noqa: E402
from gateway.store.db import create_db  # noqa: E402
from gateway.store.migrate import upgrade  # noqa: E402
from gateway.store.models import to_picousd  # noqa: E402
from gateway.store.reports import spend  # noqa: E402

ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
MODELS = ["auto", "gpt-4o-mini", "claude-haiku-4-5", "SmolLM2-135M-Instruct"]
BACKENDS = ["local", "openai", "anthropic"]


async def fill(url: str, rows: int, keys: int) -> None:
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    rng = random.Random(0)
    start = datetime(2026, 10, 1, tzinfo=UTC)
    key_ids = [uuid.uuid4().hex for _ in range(keys)]
    columns = ["id", "created_at", "finished_at", "key_id", "team", "requested_model", "backend", "status",
               "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms", "attempts",
               "cost_picousd", "reference_cost_picousd", "cost_estimated"]  # fmt: skip
    chunk = 50_000
    for offset in range(0, rows, chunk):
        records = []
        for i in range(offset, min(rows, offset + chunk)):
            created = start + timedelta(seconds=rng.randrange(31 * 86400))
            backend = rng.choice(BACKENDS)
            prompt, completion = rng.randrange(10, 4000), rng.randrange(1, 800)
            cost = (prompt * 150 + completion * 600) * 1000  # picodollars
            reference = (prompt * 2500 + completion * 10000) * 1000 if backend == "local" else None
            key = rng.choice(key_ids)
            team, model = f"team{int(key[:4], 16) % 20}", rng.choice(MODELS)
            records.append((f"req-{i}", created, created, key, team, model, backend, 200, prompt,
                            completion, 0, Decimal("12.5"), 1, cost, reference, False))  # fmt: skip
        await conn.copy_records_to_table("request_logs", records=records, columns=columns)
    await conn.execute("""
        INSERT INTO usage_daily (day, key_id, team, requested_model, backend, requests, errors, prompt_tokens,
                                 completion_tokens, cached_tokens, cost_picousd, reference_cost_picousd,
                                 reference_basis_picousd)
        SELECT (created_at AT TIME ZONE 'UTC')::date, key_id, team, requested_model, backend, count(*),
               count(*) FILTER (WHERE status <> 200), sum(prompt_tokens), sum(completion_tokens),
               sum(cached_tokens), sum(cost_picousd), coalesce(sum(reference_cost_picousd), 0),
               coalesce(sum(cost_picousd) FILTER (WHERE reference_cost_picousd IS NOT NULL), 0)
        FROM request_logs GROUP BY 1, 2, 3, 4, 5
    """)
    await conn.execute("ANALYZE")
    print(f"filled {rows:,} request rows, {await conn.fetchval('SELECT count(*) FROM usage_daily'):,} "
          "daily aggregate rows")  # fmt: skip
    await conn.close()


async def time_reports(url: str) -> None:
    db = create_db(url)
    raw = await asyncpg.connect(url.replace("+asyncpg", ""))
    for by, column in (("model", "requested_model"), ("key", "key_id")):
        timings = []
        for _ in range(5):
            t = time.perf_counter()
            await spend(db, date(2026, 10, 1), date(2026, 10, 31), by)  # type: ignore[arg-type]
            timings.append(time.perf_counter() - t)
        t = time.perf_counter()
        await raw.fetch(f"SELECT {column}, count(*), sum(prompt_tokens), sum(completion_tokens), "
                        "sum(cost_picousd) "
                        f"FROM request_logs WHERE created_at >= '2026-10-01' AND created_at < '2026-11-01' "
                        f"GROUP BY {column}")  # fmt: skip
        scan = time.perf_counter() - t
        best = min(timings)
        median = statistics.median(timings) * 1e3
        print(f"month by {by:<5}: from aggregates {best * 1e3:8.1f} ms (median {median:.1f}) "
              f"| scanning the raw log {scan * 1e3:8.1f} ms  ({scan / best:.0f}x)")  # fmt: skip
    await raw.close()
    await db.dispose()


async def time_enforcement(requests: int) -> None:
    async def nothing(budget: Budget, start: datetime) -> int:
        return 0

    stores: list[tuple[str, LocalRateLimiter | RedisRateLimiter, LocalBudgetStore | RedisBudgetStore]] = [
        ("in-process", LocalRateLimiter(), LocalBudgetStore()),
        ("redis (loopback)", RedisRateLimiter(REDIS), RedisBudgetStore(REDIS)),
    ]
    for label, limiter, store in stores:
        subject = uuid.uuid4().hex
        key = Budget("key", subject, Decimal(10**9), "monthly")
        team = Budget("team", subject + "-team", Decimal(10**9), "monthly")
        limits = [Limit(f"{who}:{subject}:{kind}", 10**9, cost, kind)
                  for who in ("key", "team") for kind, cost in (("rpm", 1), ("tpm", 500))]  # fmt: skip
        before, after = [], []
        for i in range(requests + 50):
            now = datetime.now(UTC)
            charges = []
            for budget in (key, team):
                counter, start, reset = budget.counter(now)
                charges.append(Charge(budget, counter, start, reset, to_picousd(Decimal("0.01"))))
            t = time.perf_counter()
            if isinstance(store, RedisBudgetStore) and isinstance(limiter, RedisRateLimiter):
                await store.admit(limits, limiter.prefix, charges, nothing)  # one round trip, as the gateway
            else:
                await limiter.acquire(limits)  # before the call: on the request path
                await store.reserve(charges, nothing)
            t2 = time.perf_counter()
            await limiter.adjust(limits[1], -100)  # after the response: tokens and money reconciled
            await limiter.adjust(limits[3], -100)
            for charge in charges:
                await store.settle(charge, to_picousd(Decimal("0.004")))
            if i >= 50:
                before.append(t2 - t)
                after.append(time.perf_counter() - t2)
        for phase, samples in (("before the call", before), ("after the response", after)):
            samples.sort()
            p50, p99 = samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6
            print(f"enforcement {label:<17} {phase:<19}: p50 {p50:7.1f} us  p99 {p99:7.1f} us")
        await limiter.close()
        await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    name = f"gw_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    try:
        await asyncio.to_thread(upgrade, url)
        t = time.perf_counter()
        await fill(url, args.rows, args.keys)
        print(f"(fill took {time.perf_counter() - t:.0f} s)")
        await time_reports(url)
        await time_enforcement(args.requests)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
