"""`python -m gateway serve | dev | db ... | keys create | policy check | route eval|explain`: the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import uvicorn
from alembic.util import CommandError
from pydantic import ValidationError
from uvicorn.importer import import_from_string

from gateway.api.admin_keys import KeyCreate
from gateway.api.asgi import ASGIApp
from gateway.api.http_protocol import LimitedConfig
from gateway.cli.serving import CleanExitServer, WorkerSupervisor
from gateway.config.policy import EngineBackend, PolicyError, load_policy, parse_policy, read_policy_text
from gateway.config.private_files import PrivateFileError
from gateway.config.secrets import resolve_key_secret
from gateway.config.settings import GatewaySettings
from gateway.governance.keys import KeyHasher, KeyStore
from gateway.store.db import DATABASE_ERRORS, DatabaseUnavailableError, create_db, session_factory
from gateway.store.migrate import (
    SchemaMismatchError,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    require_database,
    upgrade,
    wait_for_schema,
)
from gateway.store.reports import DIMENSIONS, parse_day, render, spend
from gateway.telemetry.access_log import log_config

logger = logging.getLogger(__name__)
_POLICY_HELP = "routing policy YAML (default: $GATEWAY_POLICY_PATH, else policies/default.yaml)"


def _database_command(args: argparse.Namespace, settings: GatewaySettings) -> int:
    url = settings.resolved_database_url
    if args.db_command == "upgrade":
        upgrade(url, args.revision)
        print(f"database at revision {asyncio.run(current_revision(url))}")
    elif args.db_command == "downgrade":
        downgrade(url, args.revision)
        print(f"database at revision {asyncio.run(current_revision(url))}")
    elif args.db_command == "wait":
        if not math.isfinite(args.timeout):  # (nan waited for ever)
            raise ValueError("--timeout must be a number of seconds")
        print(f"database at revision {asyncio.run(wait_for_schema(url, args.timeout))}")
    else:
        require_database(url)  # it only reads: it must not create an empty database
        print(f"database at revision {asyncio.run(current_revision(url))}; code expects {head_revision()}")
    return 0


async def _create_key(args: argparse.Namespace, settings: GatewaySettings) -> dict[str, object]:
    hasher = KeyHasher(resolve_key_secret(settings))  # before the database: a missing secret is named first
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    body = KeyCreate.model_validate(  # what the admin API refuses, this refuses alike
        {"name": args.name, "team": args.team, "allowed_models": models, "rpm_limit": args.rpm,
         "tpm_limit": args.tpm, "expires_in_days": args.expires_in_days,
         "metadata": json.loads(args.metadata)}
    )  # fmt: skip
    url = settings.resolved_database_url
    if not settings.dev_mode:  # (dev mode creates and migrates its own database)
        require_database(url)
    await ensure_schema(url, auto_upgrade=settings.dev_mode)
    db = create_db(url)
    try:
        store = KeyStore(session_factory(db), hasher, 0.0)
        expiry, limits = body.expiry(), (body.rpm_limit, body.tpm_limit)
        info, plaintext = await store.create(
            body.name, body.team, body.allowed_models, expiry, body.metadata, *limits
        )
        return {**info.public(), "key": plaintext}
    finally:
        await db.dispose()


async def _report(args: argparse.Namespace, settings: GatewaySettings) -> str:
    url = settings.resolved_database_url
    require_database(url)  # a report only reads: it must not create an empty database
    own = _self_hosted(args.policy, settings) if args.format == "html" else frozenset()
    await ensure_schema(url, auto_upgrade=False)
    db = create_db(url)
    try:
        if args.format == "html":
            from gateway.store.report_html import html_report

            return await html_report(db, args.start, args.end, own)
        return render(await spend(db, args.start, args.end, args.by), args.format, args.by)
    finally:
        await db.dispose()


def _self_hosted(given: Path | None, settings: GatewaySettings) -> frozenset[str]:
    """The policy's engine backends, for the HTML report's self-hosted share: from --policy, else
    the gateway's own (GATEWAY_POLICY_PATH, default policies/default.yaml, relative to the current
    folder as `serve` reads it), named in the error when it is not there."""
    path = given or settings.policy_path
    if given is None and not path.exists():
        raise PolicyError(
            f"--format html reads the policy to tell self-hosted backends from hosted ones, and {path} "
            f"is not there (in {Path.cwd()}): give --policy FILE or set GATEWAY_POLICY_PATH"
        )
    policy = load_policy(path)
    return frozenset(n for n, b in policy.backends.items() if isinstance(b, EngineBackend))


def _serve(args: argparse.Namespace) -> int:
    # the flag wins over GATEWAY_POLICY_PATH, which wins over the default, policies/default.yaml
    settings = GatewaySettings() if args.policy is None else GatewaySettings(policy_path=args.policy)
    settings.require_secrets()  # fail here, naming the missing variables, not in a worker
    # fail here, with the path in the message, not in a worker; a regular file only, as the server
    # and its watcher read it again (a pipe, read once here, was empty there or blocked the start)
    policy = parse_policy(read_policy_text(settings.policy_path), str(settings.policy_path))
    _startable(settings, policy)
    config = server_config(settings, args)
    if args.workers > 1 and not settings.redis_url:
        print(f"warning: {args.workers} workers without GATEWAY_REDIS_URL: each keeps its own rate-limit "
              f"and budget counters, so keys may use up to {args.workers}x their limits and budgets",
              file=sys.stderr, flush=True)  # fmt: skip
    if args.workers > 1:  # uvicorn's supervisor, forwarding every stop signal to the workers
        supervisor = WorkerSupervisor(config, sockets=[config.bind_socket()])
        supervisor.run()
        return 0 if supervisor.signalled else 3  # (it stops by itself when a worker fails to start)
    server = CleanExitServer(config)
    server.run()
    return 0 if server.started else 1


def _startable(settings: GatewaySettings, policy: Any) -> None:
    """What every worker would fail on, checked once here with a one-line error: the policy's
    complexity weights (as `policy check`), a database unreachable or not at this code's
    revision (in dev mode it is migrated here, once, not by each worker at the same time)."""
    from gateway.routing.complexity import ComplexityModel
    from gateway.routing.router import Router

    Router(policy, ComplexityModel.load())
    asyncio.run(ensure_schema(settings.resolved_database_url, auto_upgrade=settings.dev_mode))


@dataclass(frozen=True)
class AppFactory:
    """uvicorn's app factory for `serve`: create_app with the settings this command read.

    Spawned worker processes get it pickled inside the config, settings included, so the CLI need
    not write `--policy` into the environment for them. create_app is named by its import string,
    as uvicorn names apps: the composition root sits above the CLI.
    """

    settings: GatewaySettings
    target: str = "gateway.main:create_app"

    def __call__(self) -> ASGIApp:
        create_app = import_from_string(self.target)
        app: ASGIApp = create_app(self.settings)
        return app


def server_config(settings: GatewaySettings, args: argparse.Namespace) -> LimitedConfig:
    """uvicorn's configuration for `serve`: the app factory, the address and the connection limits."""
    return LimitedConfig(
        AppFactory(settings), factory=True, host=args.host, port=args.port, workers=args.workers,
        log_level=args.log_level, access_log=False,
        log_config=log_config(uvicorn.config.LOGGING_CONFIG, enabled=not args.no_access_log),
        max_header_bytes=settings.max_header_bytes, header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        limit_concurrency=settings.limit_concurrency, timeout_keep_alive=settings.keep_alive_timeout,
        backlog=settings.backlog, timeout_graceful_shutdown=settings.shutdown_timeout,
        proxy_headers=True, forwarded_allow_ips=settings.forwarded_allow_ips,
        ws="none",  # no route speaks WebSocket: an upgrade request is answered as plain HTTP
        server_header=False,  # no `server: uvicorn` in every answer
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m gateway", description="Switchboard AI gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway (OpenAI-compatible endpoint, admin API)")
    serve.add_argument("--policy", type=Path, default=None, help=_POLICY_HELP)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--workers", type=_positive, default=1, help="worker processes")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--no-access-log", action="store_true", help="no JSON line per request on stdout (switchboard.access)"
    )
    dev = sub.add_parser("dev", help="run the engine and the gateway together in dev mode (make run)")
    dev.add_argument("--model", default="default", help="engine model: 'default' or a local HF folder")
    dev.add_argument("--port", type=_port, default=8000, help="gateway port")
    dev.add_argument("--engine-port", type=_port, default=8001)
    dev.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more `engine serve` option, as --engine-option=--no-batch-invariant (repeatable)",
    )
    database = sub.add_parser("db", help="database schema migrations (Alembic)")
    database_sub = database.add_subparsers(dest="db_command", required=True)
    up = database_sub.add_parser("upgrade", help="migrate up (to the newest revision by default)")
    up.add_argument("revision", nargs="?", default="head")
    down = database_sub.add_parser("downgrade", help="migrate down to REVISION ('base' drops every table)")
    down.add_argument("revision")
    database_sub.add_parser("current", help="the database's revision and the one this code expects")
    wait = database_sub.add_parser(
        "wait", help="wait until the database is at this code's revision (exit 2 after --timeout seconds)"
    )
    wait.add_argument("--timeout", type=float, default=600.0)
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
    create.add_argument("--rpm", type=_positive, default=None, help="requests per minute (default: no limit)")
    create.add_argument("--tpm", type=_positive, default=None, help="tokens per minute (default: no limit)")
    _routing_commands(sub)
    report = sub.add_parser("report", help="finance reports (from the daily aggregates)")
    report_sub = report.add_subparsers(dest="report_command", required=True)
    spend = report_sub.add_parser("spend", help="spend, tokens and savings over a date range")
    spend.add_argument("--from", dest="start", type=_day, required=True, help="YYYY-MM-DD")
    spend.add_argument("--to", dest="end", type=_day, required=True, help="YYYY-MM-DD, included")
    spend.add_argument("--by", choices=DIMENSIONS, default="key")
    spend.add_argument("--format", choices=["table", "csv", "json", "html"], default="table")
    spend.add_argument("--policy", type=Path, default=None, help="which backends are self-hosted (html)")
    args = parser.parse_args(argv)
    try:
        if args.command in ("policy", "route"):
            return _routing(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "dev":
            from gateway.cli.dev import run_dev_stack

            return run_dev_stack(args.model, args.port, args.engine_port, engine_options=args.engine_option)
        settings = GatewaySettings()  # the secrets are checked by the commands that use them
        if args.command == "db":
            return _database_command(args, settings)
        if args.command == "report":
            text = asyncio.run(_report(args, settings))  # (a CSV ends its last row: no blank row after)
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            return 0
        print(json.dumps(asyncio.run(_create_key(args, settings)), indent=2))
        return 0
    except _ERRORS as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: Exception) -> str:
    """An error as one line: pydantic's per field (a setting named by its variable), a database
    driver's first line (not its SQL, nor SQLAlchemy's link)."""
    if isinstance(exc, ValidationError):
        settings = exc.title == GatewaySettings.__name__
        return "; ".join(
            (f"GATEWAY_{str(e['loc'][0]).upper()}" if settings and e["loc"] else ".".join(map(str, e["loc"])))
            + f": {e['msg']}"
            for e in exc.errors()
        )
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


# What a command reports as `error: ...` (exit 2); the database failing included
_ERRORS: tuple[type[Exception], ...] = (
    ValidationError, SchemaMismatchError, PolicyError, ValueError, DatabaseUnavailableError, *DATABASE_ERRORS,
    CommandError, PrivateFileError, RecursionError,
)  # fmt: skip


def _day(text: str) -> date:
    """A report's day, parsed as the admin API and the console parse it, with their message."""
    try:
        return parse_day(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:  # (99999 was bound as 34463, its remainder; 0: any free port)
        raise argparse.ArgumentTypeError("must be a port, 0 to 65535")
    return value


def _routing_commands(sub: Any) -> None:
    policy = sub.add_parser("policy", help="routing policy files")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate a policy file offline (exit 0 valid, 1 invalid)")
    check.add_argument("file", type=Path)
    route = sub.add_parser("route", help="complexity routing, offline")
    route_sub = route.add_subparsers(dest="route_command", required=True)
    evaluate = route_sub.add_parser("eval", help="accuracy of the tier choice on labelled JSONL rows")
    evaluate.add_argument("--policy", type=Path, default=None, help=_POLICY_HELP)
    evaluate.add_argument("--data", type=Path, required=True, help="JSONL: {label: simple|complex, messages}")
    evaluate.add_argument("--route", default=None, help="the tiered route (default: the first one)")
    explain = route_sub.add_parser("explain", help="features, score, tier and chain for one request")
    explain.add_argument("--policy", type=Path, default=None, help=_POLICY_HELP)
    explain.add_argument("prompt", nargs="?", default=None, help="a user message")
    explain.add_argument(
        "--messages", type=Path, default=None, help="a JSON file: messages or a request body"
    )
    explain.add_argument("--route", default=None, help="the route or model asked for (default: first tiered)")
    explain.add_argument("--team", default=None, help="route as a key of this team (overrides apply)")


def _routing(args: argparse.Namespace) -> int:
    from gateway.cli import route as cli_route

    if args.command == "policy":
        return cli_route.policy_check(args.file)
    # the gateway's own policy unless --policy names another: what `serve` would route by
    policy = args.policy if args.policy is not None else GatewaySettings().policy_path
    if args.route_command == "eval":
        figures = cli_route.route_eval(policy, args.data, args.route)
        print(f"n {figures['n']:.0f}  accuracy {figures['accuracy']:.3f}  precision(complex) "
              f"{figures['precision']:.3f}  recall(complex) {figures['recall']:.3f}  "
              f"sent to frontier {figures['frontier_share']:.3f}")  # fmt: skip
        return 0
    if (args.prompt is None) == (args.messages is None):
        raise ValueError("give a prompt or --messages FILE (one of them)")
    if args.messages is not None:
        loaded = json.loads(args.messages.read_text(encoding="utf-8"))
        body: dict[str, Any] = loaded if isinstance(loaded, dict) else {"messages": loaded}
    else:
        body = {"messages": [{"role": "user", "content": args.prompt}]}
    if args.route is not None:
        body["model"] = args.route
    print(cli_route.route_explain(policy, body, args.route, args.team))
    return 0


if __name__ == "__main__":
    sys.exit(main())
