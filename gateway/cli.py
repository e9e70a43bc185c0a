"""`python -m gateway db upgrade|downgrade|current | keys create`: the gateway's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from gateway.auth import KeyHasher, KeyStore
from gateway.db import create_engine, session_factory
from gateway.migrate import (
    SchemaMismatchError,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    upgrade,
)
from gateway.secrets_store import resolve_secrets
from gateway.settings import GatewaySettings


def _db(args: argparse.Namespace, settings: GatewaySettings) -> int:
    url = settings.resolved_database_url
    if args.db_command == "upgrade":
        upgrade(url, args.revision)
        print(f"database at revision {asyncio.run(current_revision(url))}")
    elif args.db_command == "downgrade":
        downgrade(url, args.revision)
        print(f"database at revision {asyncio.run(current_revision(url))}")
    else:
        print(f"database at revision {asyncio.run(current_revision(url))}; code expects {head_revision()}")
    return 0


async def _create_key(args: argparse.Namespace, settings: GatewaySettings) -> dict[str, object]:
    url = settings.resolved_database_url
    await ensure_schema(url, auto_upgrade=settings.dev_mode)
    engine = create_engine(url)
    try:
        store = KeyStore(session_factory(engine), KeyHasher(resolve_secrets(settings).key_secret), 0.0)
        expires = datetime.now(UTC) + timedelta(days=args.expires_in_days) if args.expires_in_days else None
        models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
        info, plaintext = await store.create(args.name, args.team, models, expires, json.loads(args.metadata))
        return {**info.public(), "key": plaintext}
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m gateway", description="Switchboard AI gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    db = sub.add_parser("db", help="database schema migrations (Alembic)")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="migrate up (to the newest revision by default)")
    up.add_argument("revision", nargs="?", default="head")
    down = db_sub.add_parser("downgrade", help="migrate down to REVISION ('base' drops every table)")
    down.add_argument("revision")
    db_sub.add_parser("current", help="the database's revision and the one this code expects")
    keys = sub.add_parser("keys", help="virtual keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (the plaintext is shown once)")
    create.add_argument("--name", required=True)
    create.add_argument("--team", default=None)
    create.add_argument(
        "--models", default=None, help="comma-separated models the key may use (default: all)"
    )
    create.add_argument("--expires-in-days", type=float, default=None)
    create.add_argument("--metadata", default="{}", help="a JSON object")
    args = parser.parse_args(argv)
    try:
        settings = GatewaySettings()
        if args.command == "db":
            return _db(args, settings)
        print(json.dumps(asyncio.run(_create_key(args, settings)), indent=2))
        return 0
    except (ValidationError, SchemaMismatchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
