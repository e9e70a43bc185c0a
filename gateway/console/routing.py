"""/ui/routing: the active policy (read-only) with its reload status, and "explain" for a request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Response

from gateway.api.services import Watcher
from gateway.config.policy import PolicyError, read_policy_text
from gateway.console.web import CheckedForm, ConsoleSession, page
from gateway.pipeline.runtime import PolicyWatcher
from gateway.routing.explain import explain, tiered_route

router = APIRouter(prefix="/ui/routing")

MAX_EXPLAIN_CHARS = 48 << 10  # below the admin body limit (64 KiB), with room for the form's other fields


async def _policy_text(path: Path) -> tuple[str | None, str | None]:
    """The policy file's text, else None and why it cannot be shown: the file may be gone or not
    UTF-8 while the version loaded before still serves, and the page must still say that."""
    try:
        return await asyncio.to_thread(read_policy_text, path), None
    except UnicodeDecodeError as exc:  # before PolicyError: both are ValueErrors
        return None, f"policy {path} is not UTF-8 text (byte {exc.start})"
    except PolicyError as exc:  # missing, unreadable, a directory
        return None, str(exc)


async def _context(watcher: PolicyWatcher) -> dict[str, Any]:
    status = watcher.status()
    text, unreadable = await _policy_text(watcher.path)
    return {
        "title": "Routing", "active": "Routing", "status": status, "policy_text": text,
        "unreadable": unreadable, "exposed": sorted(watcher.holder.runtime.policy.exposed()), "form": {},
    }  # fmt: skip


def _body(text: str, model: str) -> tuple[dict[str, Any], int]:
    """A JSON request body as given, or a prompt made into one user message; and its size in bytes."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            body = orjson.loads(stripped)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"the body is not valid JSON ({exc.msg})") from exc
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    else:
        body = {"messages": [{"role": "user", "content": text}]}
    if model:
        body["model"] = model
    try:
        return body, len(orjson.dumps(body))
    except orjson.JSONEncodeError as exc:  # a TypeError: what orjson reads from 255 to 1,024 levels deep
        raise ValueError(f"the body nests too deeply to explain ({exc})") from exc


@router.get("")
async def routing_page(watcher: Watcher, session: ConsoleSession) -> Response:
    """The policy file, its version, its last reload and any refused change."""
    return page("routing.html", await _context(watcher), 200, session)


@router.post("/explain")
async def explain_request(form: CheckedForm, watcher: Watcher, session: ConsoleSession) -> Response:
    """Features, score, tier, capability filter and chain for a pasted prompt or request body."""
    context = {**await _context(watcher), "form": form}
    text, model, team = form.get("request", ""), form.get("model", "").strip(), form.get("team", "").strip()
    rt = watcher.holder.runtime
    try:
        if not text.strip() or len(text) > MAX_EXPLAIN_CHARS:
            raise ValueError(f"paste a prompt or a request body (at most {MAX_EXPLAIN_CHARS} characters)")
        body, size = _body(text, model)
        name = str(body.get("model") or tiered_route(rt.policy, None))
        if name not in rt.policy.exposed():
            raise ValueError(f"'{name}' is neither a model nor a route of the active policy: choose one")
        lines = await explain(rt.router, name, body, size, team or None)
    except ValueError as exc:
        return page("routing.html", {**context, "error": str(exc)}, 400, session)
    return page("routing.html", {**context, "explanation": "\n".join(lines)}, 200, session)
