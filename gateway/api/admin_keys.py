"""Admin API for virtual keys (master key only): create, list, get, update, revoke, rotate."""

from __future__ import annotations

import logging
import math
import re
import unicodedata
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from gateway.api.services import Keys, Services, ServicesDep, app_services
from gateway.errors import GatewayError
from gateway.governance.keys import AuthError, InvalidKeyUpdateError, KeyInfo, KeyNotFoundError
from gateway.governance.periods import Period, counted_period, counter_restarts
from gateway.store.row_sanitizer import MAX_JSON_LEVELS, clean_json

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/admin/keys")


async def require_master_key(request: Request) -> None:
    """Dependency: `Authorization: Bearer <master key>`, compared in constant time.

    It takes the request, not the services, because AdminGate also calls it before FastAPI.
    """
    services = app_services(request.app)
    expected = services.secrets.master_key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(
            401, "Missing master key: send 'Authorization: Bearer <master key>'", "missing_api_key"
        )
    keys = services.keys
    client = (request.client.host, request.client.port) if request.client else None
    keys.check_master(token.strip(), expected, client)


# What the columns hold: the limits are INTEGER, budgets BIGINT picodollars (at most ~9.2e18).
# Non-finite values (NaN, Infinity, which Python's JSON parser accepts) are refused explicitly.
def _written(pattern: re.Pattern[str], what: str) -> Callable[[object], object]:
    """A before-validator taking a number, or a string that `pattern` reads as one (`what`), never
    true or false (pydantic's lax numbers take true as 1, and Python's parsers read "1_000" and
    "1e3" as 1000, which nobody typing a limit or a budget means)."""

    def check(value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("must be a number, not true or false")
        if isinstance(value, str) and not pattern.fullmatch(value):
            raise ValueError(f"must be {what}")
        return value

    return check


_WHOLE = re.compile(r"[0-9]+")
# a number as text, which pydantic reads as Unix time (seconds, or milliseconds past ~2e10)
_NUMERIC = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")

# (a numeric string stays accepted: the console's forms send them)
PerMinute = Annotated[
    int, BeforeValidator(_written(_WHOLE, "a whole number written in digits")), Field(ge=1, le=2**31 - 1)
]
_plain_decimal = _written(_DECIMAL, "a number written in digits (an optional fraction after a point)")
BudgetUsd = Annotated[
    Decimal,
    BeforeValidator(_plain_decimal),
    Field(gt=0, le=Decimal(9_000_000), max_digits=20, decimal_places=12, allow_inf_nan=False),
]
MAX_EXPIRY_DAYS = 36_500  # a hundred years: longer is "never", which is leaving the expiry out
# finite and bounded: 1e308 days or inf overflowed timedelta (a 500); NaN compares false to any bound
ExpiryDays = Annotated[
    float, BeforeValidator(_plain_decimal), Field(gt=0, le=MAX_EXPIRY_DAYS, allow_inf_nan=False)
]


def _text_only(value: Any) -> Any:
    """`value` (JSON) when every string in it, keys included, is storable text: a lone surrogate
    (JSON's "\\ud800") or NUL would be stored by one driver and break reading it back."""
    if clean_json(value) != value:
        raise ValueError("a string holds a NUL or a lone surrogate: not storable text")
    return value


# Refused in names: control characters and line separators (U+2028/2029), and the format
# characters (direction overrides, isolates and marks: a name holding one reads otherwise than it
# is, "Trojan Source"; zero-width spaces, a byte order mark, soft hyphens, tags: two names that
# look alike would be two keys), joiners aside (emoji and Persian need them); Hangul fillers, which
# show as nothing, too.
_REFUSED_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp"))
_JOINERS = frozenset("\u200c\u200d")
_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")  # Hangul fillers, the Braille blank: not seen
# a subdivision flag (England's, Scotland's, Wales'): a black flag, tag characters, a cancel tag
_SUBDIVISION_FLAG = re.compile("\U0001f3f4[\U000e0020-\U000e007e]+\U000e007f")


def _one_line(value: str | None) -> str | None:
    """`value` (a name or team) when it shows as what it is on one line: no control character or
    line separator, no format character but a joiner (or a subdivision flag's tags), and something
    visible. Names reach terminals (`gateway keys list`), log lines and reports, where an escape or
    a line break acts."""
    if value is None:
        return None
    shown = _SUBDIVISION_FLAG.sub("\U0001f3f4", value) if "\U0001f3f4" in value else value
    if any(unicodedata.category(c) in _REFUSED_CATEGORIES and c not in _JOINERS for c in shown):
        raise ValueError(
            "holds a control character (a line break, an escape, a direction control or an invisible one)"
        )
    if not any(unicodedata.category(c)[0] in "LNPS" and c not in _FILLERS for c in shown):
        raise ValueError("shows nothing (blank)")
    return value


def _first_non_finite(value: Any, where: str) -> str | None:
    """Where in JSON `value` the first NaN or infinite number is (None: nowhere). Python's parser
    reads NaN, Infinity and 1e400 as floats: SQLite stored them as invalid JSON, PostgreSQL refused."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    if isinstance(value, dict):
        children = [(f"{where}.{k}", v) for k, v in value.items()]
    elif isinstance(value, list):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    return next((w for path, v in children if (w := _first_non_finite(v, path)) is not None), None)


# Deeper metadata broke more than it carried: from ~254 levels the response could not be serialized
# (the key was stored, and every later listing was a 500), from ~490 these walks overflowed the stack.
MAX_METADATA_DEPTH = MAX_JSON_LEVELS  # what a stored row is read back with


def _depth(value: Any) -> int:
    """How many levels of objects and arrays JSON `value` nests (walked without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _json_only(value: Any, name: str) -> Any:
    """`value` (field `name`) when it nests at most MAX_METADATA_DEPTH levels and is storable text
    (see `_text_only`) with only finite numbers."""
    if _depth(value) > MAX_METADATA_DEPTH:
        raise ValueError(f"nests deeper than {MAX_METADATA_DEPTH} levels of objects and arrays")
    where = _first_non_finite(_text_only(value), name)
    if where is not None:
        raise ValueError(f"{where} is NaN or infinite: JSON numbers are finite")
    return value


def _utc(value: datetime | None) -> datetime | None:
    """`value` as the same instant in UTC (a time without a zone is UTC, as keys are read back):
    SQLite drops the offset and kept another zone's wall time, PostgreSQL converted. A time that
    leaves years 1..9999 once in UTC is refused here, on both, not by one database."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError("out of range once converted to UTC (years 1 to 9999)") from exc


class _KeyFields(BaseModel):
    """The checks both key bodies make alike (on their own fields: `check_fields=False`)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("name", "team", "allowed_models", check_fields=False)
    @classmethod
    def _storable(cls, value: object) -> object:
        return _text_only(value)

    @field_validator("name", "team", check_fields=False)
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        return _one_line(value)

    @field_validator("allowed_models", check_fields=False)
    @classmethod
    def _printable_models(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            _one_line(name)  # a model's name as a name: a line break in one split it in the console
        return value

    @field_validator("metadata", check_fields=False)
    @classmethod
    def _json(cls, value: object) -> object:
        return _json_only(value, "metadata")

    @field_validator("expires_at", mode="before", check_fields=False)
    @classmethod
    def _a_date(cls, value: object) -> object:
        """A date and time as text (ISO 8601): a number was read as seconds, or past ~2e10 as
        milliseconds, since 1970 (year 10000 in seconds was stored as 1978)."""
        if isinstance(value, int | float) or (isinstance(value, str) and _NUMERIC.fullmatch(value)):
            raise ValueError("must be a date and time as text (ISO 8601), not a number")
        return value

    @field_validator("expires_at", check_fields=False)
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return _utc(value)


class KeyCreate(_KeyFields):
    """POST /admin/keys."""

    name: str = Field(min_length=1, max_length=200)
    team: str | None = Field(None, min_length=1, max_length=200)
    allowed_models: list[str] | None = None
    expires_at: datetime | None = None
    expires_in_days: ExpiryDays | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    rpm_limit: PerMinute | None = None
    tpm_limit: PerMinute | None = None
    budget_usd: BudgetUsd | None = None
    budget_period: Period = "monthly"

    @model_validator(mode="after")
    def _one_expiry(self) -> KeyCreate:
        if self.expires_at is not None and self.expires_in_days is not None:
            raise ValueError("give expires_at or expires_in_days, not both")
        return self

    def expiry(self) -> datetime | None:
        """Absolute expiry from either field."""
        if self.expires_in_days is not None:
            return datetime.now(UTC) + timedelta(days=self.expires_in_days)
        return self.expires_at


class KeyUpdate(_KeyFields):
    """PATCH /admin/keys/{id}: only the fields given change; null clears an optional one.

    Null lifts a limit (`rpm_limit`, `tpm_limit`), removes the budget (`budget_usd`, and its
    period with it), the team, the model list (every model) or the expiry. `name`, `metadata` and
    `budget_period` cannot be null.
    """

    name: str | None = Field(None, min_length=1, max_length=200)
    team: str | None = Field(None, min_length=1, max_length=200)
    allowed_models: list[str] | None = None
    expires_at: datetime | None = None
    metadata: dict[str, Any] | None = None
    rpm_limit: PerMinute | None = None
    tpm_limit: PerMinute | None = None
    budget_usd: BudgetUsd | None = None
    budget_period: Period | None = None

    @field_validator("name", "metadata", "budget_period")
    @classmethod
    def _not_null(cls, value: object) -> object:
        """Runs only on given values: an explicit null, not an absent field, is refused."""
        if value is None:
            raise ValueError("cannot be null (leave the field out to keep its value)")
        return value


admin = [Depends(require_master_key)]


@router.post("", status_code=201, dependencies=admin)
async def create_key(body: KeyCreate, keys: Keys) -> dict[str, Any]:
    """Create a key; the plaintext `key` is in this response only."""
    if body.budget_usd is None and "budget_period" in body.model_fields_set:  # as PATCH answers it
        raise InvalidKeyUpdateError(
            "budget_period", "the key has no budget to give a period: set budget_usd as well"
        )
    info, plaintext = await keys.create(
        body.name,
        body.team,
        body.allowed_models,
        body.expiry(),
        body.metadata,
        rpm_limit=body.rpm_limit,
        tpm_limit=body.tpm_limit,
        budget_usd=body.budget_usd,
        budget_period=body.budget_period if body.budget_usd is not None else None,
    )
    return {**info.public(), "key": plaintext}


@router.get("", dependencies=admin)
async def list_keys(
    keys: Keys,
    team: Annotated[str | None, Query(min_length=1, max_length=200)] = None,  # as a key's team
    include_revoked: bool = True,
    limit: Annotated[int | None, Query(ge=1, le=1000)] = None,
    after: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
) -> dict[str, Any]:
    """The keys (never a plaintext), newest first: every one, or `limit` a page after the key whose
    id is `after` (OpenAI's list shape: `has_more`, `first_id`, `last_id`)."""
    try:
        found = await keys.list(team, include_revoked, None if limit is None else limit + 1, after)
    except KeyNotFoundError as exc:
        message = f"after: no key with id {after}"
        raise GatewayError(400, message, param="after", code="invalid_value") from exc
    page = found if limit is None else found[:limit]
    data = [k.public() for k in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {
        "object": "list",
        "data": data,
        "first_id": first,
        "last_id": last,
        "has_more": len(found) > len(page),
    }


@router.get("/{key_id}", dependencies=admin)
async def get_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """One key."""
    return (await keys.get(key_id)).public()


@router.patch("/{key_id}", dependencies=admin)
async def update_key(key_id: str, body: KeyUpdate, services: ServicesDep) -> dict[str, Any]:
    """Change name, team, allowed models, expiry, metadata, rate limits or budget."""
    return (await apply_update(key_id, body, services)).public()


async def apply_update(key_id: str, body: KeyUpdate, services: Services) -> KeyInfo:
    """A key changed as `body` says (its set fields), for the admin API and the console alike: a
    budget given back or moved to another period restarts its counter from the log (the stale one
    had let a key spend past its new budget until it expired)."""
    keys = services.keys
    fields = body.model_dump(exclude_unset=True)
    before = await keys.get(key_id) if {"budget_usd", "budget_period"} & set(fields) else None
    updated = await keys.update(key_id, **fields)
    if before is not None and counter_restarts(_period(before), _period(updated)):
        budgets = services.proxy.admission.budgets
        try:
            await budgets.forget("key", key_id)
        except Exception:  # the change stands; the old counter is counted on until it expires
            logger.exception("key %s: its budget counters could not be reset", key_id)
    return updated


def _period(key: KeyInfo) -> Period | None:
    """The period a key's budget counts over (None: no budget), as admission reads it."""
    return None if key.budget_usd is None else counted_period(key.budget_period)


@router.post("/{key_id}/revoke", dependencies=admin)
async def revoke_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """Stop the key (every replica within the key cache TTL)."""
    return (await keys.revoke(key_id)).public()


@router.post("/{key_id}/rotate", dependencies=admin)
async def rotate_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """Replace the key's secret; the new plaintext `key` is in this response only."""
    info, plaintext = await keys.rotate(key_id)
    return {**info.public(), "key": plaintext}
