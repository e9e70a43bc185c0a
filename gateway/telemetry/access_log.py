"""One JSON line per completion request on the `switchboard.access` logger.

Built from the request's record (its request-log row, written anyway), once, at its end. The line
names the key by its id and stored display prefix, never the key; prompt and completion text
appear only when the policy's `log_bodies` is on (as in the database log). `python -m gateway
serve` sends this logger, unformatted, to stdout.

A log record costs more than the rest of the line (findCaller, thread and process lookups, a
flush per record), so lines are gathered and handed to the logger together: one record, one
line per request, at most `interval` s after the first of them (and at shutdown). A request
pays for a dict, `orjson.dumps` and a list append.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.store.record import RequestRecord

ACCESS_LOGGER = "switchboard.access"


class AccessLog:
    """Writes the access line of each request (nothing when the logger is above INFO)."""

    def __init__(
        self, logger: logging.Logger | None = None, interval: float = 0.05, batch: int = 256
    ) -> None:
        self._logger = logger or logging.getLogger(ACCESS_LOGGER)
        self._interval = interval
        self._batch = batch
        self._pending: list[bytes] = []

    def record(self, rec: RequestRecord) -> None:
        """One line from a finished request's record (a RecordSink)."""
        if not self._logger.isEnabledFor(logging.INFO):
            return
        row, trace_ids = rec.row, rec.trace_ids
        status = row["status"]
        cost = row["cost_picousd"]
        line: dict[str, Any] = {
            "ts": row["finished_at"],
            "level": "info" if status < 500 else "error",
            "request_id": row["id"],
            "trace_id": trace_ids[0] if trace_ids else None,
            "span_id": trace_ids[1] if trace_ids else None,
            "key_id": row["key_id"],
            "key_prefix": rec.key_prefix,
            "team": row["team"],
            "model": row["requested_model"],
            "route": row["route_reason"],
            "tier": row["route_tier"],
            "complexity_score": row["complexity_score"],
            "backend": row["backend"],
            "replica": row["deployment"],
            "status": status,
            "error": row["error_type"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "cached_tokens": row["cached_tokens"],
            "latency_ms": row["latency_ms"],
            "ttft_ms": row["ttft_ms"],
            "overhead_ms": row["overhead_ms"],
            "cost_usd": float(cost) if cost is not None else None,
            "cost_estimated": row["cost_estimated"],
            "failovers": len(rec.attempts),
            "failover": row["failover"],
            "attempts": row["attempts"],
            "resumptions": row["resumptions"],
            "stream": rec.stream,
        }
        if row["request_body"] is not None or row["response_body"] is not None:  # log_bodies is on
            line["request_body"] = row["request_body"]
            line["response_body"] = row["response_body"]
        self._pending.append(orjson.dumps(line))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_later(self._interval, self.flush)
        elif len(self._pending) >= self._batch:
            self.flush()

    def flush(self) -> None:
        """Hand the lines gathered so far to the logger (one record, one line per request)."""
        if self._pending:
            lines, self._pending = self._pending, []
            self._logger.info(b"\n".join(lines).decode())


def log_config(base: Mapping[str, Any], enabled: bool) -> dict[str, Any]:
    """A logging dictConfig: `base` (uvicorn's) plus the access logger, bare lines to stdout."""
    config = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    config["formatters"] = {**config.get("formatters", {}), "switchboard_access": {"format": "%(message)s"}}
    config["handlers"] = {
        **config.get("handlers", {}),
        "switchboard_access": {
            "class": "logging.StreamHandler",
            "formatter": "switchboard_access",
            "stream": "ext://sys.stdout",
        },
    }
    config["loggers"] = {
        **config.get("loggers", {}),
        ACCESS_LOGGER: {
            "handlers": ["switchboard_access"],
            "level": "INFO" if enabled else "CRITICAL",
            "propagate": False,
        },
    }
    return config
