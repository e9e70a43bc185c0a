"""The key report names every key that spent, however many: no statement with a parameter per key."""

from __future__ import annotations

import asyncio
from datetime import date

from sqlalchemy import text

from gateway.store.db import create_db
from gateway.store.migrate import upgrade
from gateway.store.reports import spend

KEYS = 33_000  # past asyncpg's 32,767 parameters per statement

_COLUMNS = (
    "day, key_id, team, requested_model, backend, requests, errors, prompt_tokens, completion_tokens, "
    "cached_tokens, cost_picousd, reference_cost_picousd, reference_basis_picousd"
)


def test_a_key_report_over_more_keys_than_a_statement_takes_parameters(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> list[tuple[str, str]]:
        db = create_db(database_url)
        try:
            async with db.begin() as conn:
                numbers = (
                    f"SELECT generate_series(1, {KEYS}) AS n"
                    if database_url.startswith("postgresql")
                    else f"WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {KEYS}) "
                    "SELECT n FROM g"
                )
                await conn.execute(
                    text(
                        f"INSERT INTO usage_daily ({_COLUMNS}) SELECT :day, 'k' || n, '', 'm', 'b', "
                        f"1, 0, 1, 1, 0, 1000 + n, 0, 0 FROM ({numbers}) AS numbers"
                    ),
                    {"day": date(2026, 1, 1)},
                )
                await conn.execute(
                    text("INSERT INTO api_keys (id, key_hash, key_prefix, name, metadata) VALUES "
                         "('k7', 'h7', 'sk-x', 'seventh', '{}')")
                )  # fmt: skip
            rows = await spend(db, date(2026, 1, 1), date(2026, 1, 1), "key")
            return [(r.group, r.label) for r in rows]
        finally:
            await db.dispose()

    rows = asyncio.run(run())
    assert len(rows) == KEYS and rows[0] == (f"k{KEYS}", f"k{KEYS}")  # dearest first
    assert ("k7", "seventh") in rows  # a key's name where the key is known
