"""/ui/keys: list, create (plaintext shown once), edit limits and budgets, revoke, rotate.

Forms are checked with the admin API's own models (`KeyCreate`, `KeyUpdate`), so the console
accepts exactly what `POST /admin/keys` and `PATCH /admin/keys/{id}` accept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any
from urllib.parse import urlencode

import orjson
from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError

from gateway.api.admin_keys import KeyCreate, KeyUpdate, apply_update
from gateway.api.services import Database, Keys, Services, ServicesDep
from gateway.console.data import key_spend
from gateway.console.session import Session, SessionSigner
from gateway.console.web import CheckedForm, ConsoleSession, page, redirect, signer
from gateway.governance.keys import KeyInfo, KeyNotFoundError
from gateway.governance.periods import counted_period
from gateway.store.reports import usd

router = APIRouter(prefix="/ui/keys")

PAGE_KEYS = 100  # keys a page (their spend is one query over the page's keys)
# What a create or rotate shows once, handed to the keys page its answer redirects to: that answer
# was the page itself, and reloading it (or going back to it) created or rotated again, the secret
# just handed out then dead. A minute, HttpOnly, this path only, cleared by the page that shows it.
SHOWN = "switchboard_console_shown"
_SHOWN_SECONDS = 60
_SHOWN_CHARS = 3800  # (a browser keeps a cookie of about 4 KB at most, its name and attributes included)
OPTIONAL = ("team", "allowed_models", "rpm_limit", "tpm_limit", "budget_usd")


def _fields(form: dict[str, str], lift_empty: bool, kept: Sequence[str] = ()) -> dict[str, Any]:
    """Form text to model fields: trimmed; empty optional fields left out (create) or null (edit).
    The models: every one when the form's choice says so, only those listed (none: none) when it
    says that, and without a choice (a form posted by a script) the names given, else every model;
    `kept`: the key's stored names (see `_model_names`). The expiry is apart: create takes days
    from now, edit a date (see `_edited_expiry`)."""
    fields: dict[str, Any] = {"name": form.get("name", "").strip()}
    for name in OPTIONAL:
        value = form.get(name, "").strip()
        if name == "allowed_models":
            access = form.get("model_access")
            models = _model_names(form.get(name, ""), kept)
            if access == "all" and models:  # (either choice alone is clear; both are a mistake)
                raise _FormError(
                    "Models: choose 'only the models listed', or clear the names to allow every model"
                )
            if access == "all":
                if lift_empty:
                    fields[name] = None
            elif access == "listed" or models:
                fields[name] = models
            elif lift_empty:
                fields[name] = None
        elif value:
            fields[name] = value
        elif lift_empty:
            fields[name] = None
    if fields.get("budget_usd") is not None:
        fields["budget_period"] = form.get("budget_period", "monthly")
    return fields


class _FormError(ValueError):
    """A form whose fields contradict each other: shown on the form, nothing saved."""


def _model_names(text: str, kept: Sequence[str] = ()) -> list[str]:
    """The models field's names, one a line or separated by commas; a line that is one of the key's
    stored names (`kept`: the edit form shows them one a line) is that name whole, so that a name
    holding a comma or spaces survives a save, and "gpt-4, claude" typed after it is two names."""
    names: list[str] = []
    for line in text.splitlines():
        if line in kept or line.strip() in kept:
            names.append(line if line in kept else line.strip())
        else:
            names.extend(name.strip() for name in line.split(",") if name.strip())
    return names


def _models_text(models: Sequence[str] | None) -> str:
    """A key's models as the form shows them: one a line."""
    return "\n".join(models or [])


def _edited_expiry(form: dict[str, str]) -> datetime | str | None:
    """The edit form's expiry for KeyUpdate: days from now when given, else the date field, which
    shows the current expiry (saved unchanged, it keeps it exactly) and empty means never."""
    days = form.get("expires_in_days", "").strip()
    if days:  # checked as the create form checks it
        return KeyCreate.model_validate({"name": "x", "expires_in_days": days}).expiry()
    return form.get("expires_at", "").strip() or None


def _problem(exc: ValidationError | _FormError) -> str:
    if isinstance(exc, _FormError):
        return str(exc)
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "form"
    return f"{where}: {first.get('msg')}"


def _state(info: KeyInfo, now: datetime) -> str:
    if info.revoked_at is not None:
        return "revoked"
    return "expired" if info.is_expired(now) else "active"


async def _rows(keys: Keys, db: Database, after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """One page of keys with their spend, and the next page's cursor (None: the last page)."""
    now = datetime.now(UTC)
    try:
        infos = await keys.list(None, True, PAGE_KEYS + 1, after)
    except KeyNotFoundError:  # a link to a key that is gone (or made up): the newest page
        infos = await keys.list(None, True, PAGE_KEYS + 1)
    following = infos[PAGE_KEYS - 1].id if len(infos) > PAGE_KEYS else None
    infos = infos[:PAGE_KEYS]
    periods = {k.id: counted_period(k.budget_period) for k in infos}
    spent = await key_spend(db, periods, now)
    rows = []
    for info in infos:
        spend = spent.get(info.id, Decimal(0))
        budget = info.budget_usd
        used = float(min(Decimal(1), spend / budget)) if budget else 0.0
        rows.append({**info.public(), "state": _state(info, now), "spend": usd(spend), "used": used})
    return rows, following


async def _context(keys: Keys, db: Database, after: str | None = None) -> dict[str, Any]:
    rows, following = await _rows(keys, db, after)
    after_link = f"/ui/keys?{urlencode({'after': following})}" if following else None
    return {
        "title": "Keys",
        "active": "Keys",
        "keys": rows,
        "form": {},
        "first": after is None,
        "next": after_link,
    }


async def _list(
    keys: Keys, db: Database, session: Session, after: str | None = None, **extra: Any
) -> Response:
    return page("keys.html", {**await _context(keys, db, after), **extra}, 200, session)


@router.get("")
async def keys_page(
    request: Request,
    keys: Keys,
    db: Database,
    session: ConsoleSession,
    services: ServicesDep,
    after: Annotated[str | None, Query(max_length=300)] = None,
) -> Response:
    """The keys, newest first, PAGE_KEYS a page, with their spend against their budgets; the create
    form; and, once, the secret a create or rotate just made."""
    handed = request.cookies.get(SHOWN)
    shown = _read_shown(signer(services), session, handed)
    extra = {} if shown is None else {"created": shown, "notice": shown["notice"]}
    response = await _list(keys, db, session, after, **extra)
    if handed is not None:
        response.delete_cookie(SHOWN, path="/ui/keys", httponly=True, samesite="strict")
    return response


async def _shown_once(
    request: Request, services: Services, session: Session, created: dict[str, str], notice: str
) -> Response:
    """The redirect to the keys page, carrying what it shows once in a cookie sealed to this
    session for a minute (no Max-Age: kept in memory, not written to the browser's disk); one too
    big for a browser to keep (an old, long key name) is shown on this answer instead."""
    value = signer(services).seal(session, orjson.dumps({**created, "notice": notice}).decode(), time.time())
    if len(value) > _SHOWN_CHARS:
        keys, db = services.keys, services.db
        return await _list(keys, db, session, created=created, notice=notice)
    response = redirect("/ui/keys")
    secure = services.settings.console_cookie_secure == "always" or request.url.scheme == "https"
    response.set_cookie(SHOWN, value, path="/ui/keys", secure=secure, httponly=True, samesite="strict")
    return response


def _read_shown(sealer: SessionSigner, session: Session, value: str | None) -> dict[str, str] | None:
    """What the cookie hands the page (None: none, too old, or not this session's)."""
    text = sealer.unseal(session, value, time.time(), _SHOWN_SECONDS) if value else None
    if text is None:
        return None
    try:
        shown = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    fields = ("title", "name", "key", "notice")
    if not isinstance(shown, dict) or not all(isinstance(shown.get(f), str) for f in fields):
        return None
    return {f: shown[f] for f in fields}


@router.post("")
async def create_key(
    request: Request,
    form: CheckedForm,
    keys: Keys,
    db: Database,
    session: ConsoleSession,
    services: ServicesDep,
) -> Response:
    """Create a key and show its plaintext this once (on the page this redirects to)."""
    try:
        fields = _fields(form, lift_empty=False)
        if days := form.get("expires_in_days", "").strip():
            fields["expires_in_days"] = days
        body = KeyCreate.model_validate(fields)
    except (ValidationError, _FormError) as exc:
        context = {**await _context(keys, db), "form": form, "error": _problem(exc)}
        return page("keys.html", context, 400, session)
    info, plaintext = await keys.create(
        body.name, body.team, body.allowed_models, body.expiry(), body.metadata,
        rpm_limit=body.rpm_limit, tpm_limit=body.tpm_limit, budget_usd=body.budget_usd,
        budget_period=body.budget_period if body.budget_usd is not None else None,
    )  # fmt: skip
    created = {"title": "New key", "name": info.name, "key": plaintext}
    return await _shown_once(request, services, session, created, f"Created {info.name}")


@router.get("/{key_id}")
async def edit_form(key_id: str, keys: Keys, session: ConsoleSession) -> Response:
    """One key's settings, editable."""
    info = await keys.get(key_id)
    form = {
        "name": info.name, "team": info.team or "", "rpm_limit": info.rpm_limit or "",
        "tpm_limit": info.tpm_limit or "",
        "budget_usd": f"{info.budget_usd:f}" if info.budget_usd else "",  # 1E-7 was refused when saved
        "budget_period": info.budget_period or "monthly",
        "allowed_models": _models_text(info.allowed_models),
        "model_access": "all" if info.allowed_models is None else "listed",
        "expires_at": info.public()["expires_at"] or "",
    }  # fmt: skip
    key = {**info.public(), "state": _state(info, datetime.now(UTC))}
    context = {"title": f"Key {info.name}", "active": "Keys", "key": key, "form": form}
    return page("key_edit.html", context, 200, session)


@router.post("/{key_id}")
async def update_key(
    key_id: str, form: CheckedForm, keys: Keys, session: ConsoleSession, services: ServicesDep
) -> Response:
    """Save the edit form: empty limits, budget, team or expiry lift them; the models are every
    model or only those listed (none listed: none), as the form's choice says."""
    stored = await keys.get(key_id)
    try:
        fields = _fields(form, lift_empty=True, kept=stored.allowed_models or ())
        models = None if stored.allowed_models is None else list(stored.allowed_models)
        for name, value in (("name", stored.name), ("team", stored.team), ("allowed_models", models)):
            # unchanged: kept as stored (not trimmed: " ops " is another team than "ops" to spend
            # reports and the policy's teams), and not checked again (a name stored before today's
            # rules would stop every other edit)
            if name in fields and fields[name] == (value.strip() if isinstance(value, str) else value):
                del fields[name]
        fields["expires_at"] = _edited_expiry(form)
        body = KeyUpdate.model_validate(fields)
    except (ValidationError, _FormError) as exc:
        key = {**stored.public(), "state": _state(stored, datetime.now(UTC))}
        context = {"title": f"Key {stored.name}", "active": "Keys", "key": key, "form": form}
        return page("key_edit.html", {**context, "error": _problem(exc)}, 400, session)
    await apply_update(key_id, body, services)  # as PATCH /admin/keys/{id} does: its budget counter too
    return redirect("/ui/keys")


@router.post("/{key_id}/revoke")
async def revoke_key(key_id: str, _: CheckedForm, keys: Keys) -> Response:
    """Stop the key (every replica within the key cache TTL)."""
    await keys.revoke(key_id)
    return redirect("/ui/keys")


@router.post("/{key_id}/rotate")
async def rotate_key(
    request: Request, key_id: str, _: CheckedForm, keys: Keys, session: ConsoleSession, services: ServicesDep
) -> Response:
    """Replace the key's secret and show the new plaintext this once (on the page this redirects to)."""
    info, plaintext = await keys.rotate(key_id)
    created = {"title": "Rotated key", "name": info.name, "key": plaintext}
    notice = f"Rotated {info.name}: the old secret no longer works"
    return await _shown_once(request, services, session, created, notice)
