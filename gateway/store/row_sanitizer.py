"""RowSanitizer: a request-log row made storable, value by value, so that no row can fail a batch.

A row is assembled from what clients and upstreams sent (model names, error codes, usage, bodies).
PostgreSQL refuses a whole statement over one NUL character, one lone surrogate, one integer past
its column's range or one string where a number belongs, and the writer inserts many rows per
statement. Each column gets a cleaner chosen from its SQLAlchemy type:

- text: NUL and lone surrogates become U+FFFD, other types become their `str()`, clipped to the
  column's length;
- integers: counts, so 0 <= n <= the column's maximum (int32 or int64), else NULL;
- money: a finite Decimal >= 0 that fits BIGINT picodollars, else NULL;
- floats and NUMERIC(p, s): finite and within the precision, else NULL;
- timestamps: a datetime (or an ISO string, as the spool stores them), else now / NULL;
- NOT NULL columns without a usable value take their default (`status` 0, `attempts` 1).

A changed token count or cost also sets `cost_estimated`: the figures are no longer the reported ones.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import BigInteger, Boolean, Column, DateTime, Float, Integer, Numeric, String, Table

from gateway.store.models import Money, RequestLog

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_INT_MAX = {BigInteger: 2**63 - 1, Integer: 2**31 - 1}
_MAX_USD = Decimal(9_000_000)  # BIGINT picodollars end at ~9.22e6 USD; a margin for rounding
_USAGE = frozenset(
    {"prompt_tokens", "completion_tokens", "cached_tokens", "cost_picousd", "reference_cost_picousd"}
)
_INVALID = object()  # a cleaner's answer for "no usable value": the column's fallback, marked


class _Fixed:
    """A cleaner's answer for "usable once changed" (marked); a plain value means "as given"."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


Cleaner = Callable[[Any], Any]


def clean_text(value: str) -> str:
    """`value` without NUL or lone surrogates (each becomes U+FFFD): storable by every driver."""
    if value.isascii():
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = _LONE_SURROGATE.sub("\ufffd", value)
    return value


MAX_JSON_LEVELS = 32  # of objects and arrays: a deeper stored value (~254) could not be answered


def clean_json(value: Any, levels: int = MAX_JSON_LEVELS) -> Any:
    """A JSON value (dicts, lists, scalars) with `clean_text` applied to every string in it, keys
    included, and any object or array below `levels` levels replaced by U+FFFD: equal to `value`
    exactly when all of its text is storable and it nests no deeper."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict | list) and levels < 1:
        return "\ufffd"
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_json(v, levels - 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_json(v, levels - 1) for v in value]
    return value


def _text(limit: int | None) -> Cleaner:
    def clean(value: Any) -> Any:
        if type(value) is str:
            text = clean_text(value)
        elif isinstance(value, bytes | bytearray):
            text = clean_text(bytes(value).decode("utf-8", errors="replace"))
        else:
            text = clean_text(str(value))
        if limit is not None and len(text) > limit:  # PostgreSQL counts characters, as len() does
            text = text[: limit - 1] + "…"
        return value if text is value else _Fixed(text)

    return clean


def _count(maximum: int) -> Cleaner:
    def clean(value: Any) -> Any:
        if type(value) is int:
            return value if 0 <= value <= maximum else _INVALID
        if (isinstance(value, float) and math.isfinite(value)) or (
            isinstance(value, Decimal) and value.is_finite()
        ):
            whole = int(value)
            return _Fixed(whole) if whole == value and 0 <= whole <= maximum else _INVALID
        return _INVALID  # a str, a bool, a list, NaN: nothing we can trust as a count

    return clean


def _money(value: Any) -> Any:
    if isinstance(value, Decimal):
        amount = value
    elif isinstance(value, int | float | str) and not isinstance(value, bool):
        try:  # a str is how the spool stores money: a lossless conversion, not a change
            amount = Decimal(value if isinstance(value, str) else str(value))
        except InvalidOperation:
            return _INVALID
    else:
        return _INVALID
    if not amount.is_finite() or amount < 0 or amount > _MAX_USD:
        return _INVALID
    return amount


def _real(bound: float | None) -> Cleaner:
    def clean(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
            return _INVALID
        if isinstance(value, Decimal) and not value.is_finite():
            return _INVALID
        number = float(value)
        if not math.isfinite(number) or (bound is not None and abs(number) >= bound):
            return _INVALID
        return value

    return clean


def _timestamp(value: Any) -> Any:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):  # ISO 8601, as the spool stores timestamps
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return _INVALID
    return _INVALID


def _boolean(value: Any) -> Any:
    return value if type(value) is bool else _INVALID


def _cleaner(column: Column[Any]) -> Cleaner:
    kind = column.type
    if isinstance(kind, Money):
        return _money
    if isinstance(kind, String):  # Text is a String without a length
        return _text(kind.length)
    if isinstance(kind, Integer):
        return _count(_INT_MAX[BigInteger] if isinstance(kind, BigInteger) else _INT_MAX[Integer])
    if isinstance(kind, Numeric) and not isinstance(kind, Float):
        precision, scale = kind.precision, kind.scale or 0
        # NUMERIC(12, 3) holds less than 10^9; one unit less leaves room for rounding to the scale
        return _real(10.0 ** (precision - scale) - 1 if precision is not None else None)
    if isinstance(kind, Float):
        return _real(None)
    if isinstance(kind, DateTime):
        return _timestamp
    if isinstance(kind, Boolean):
        return _boolean
    raise TypeError(f"request log column {column.name}: no cleaner for {kind!r}")


def _fast(column: Column[Any]) -> tuple[type, int]:
    """The type a column's values usually have, and the bound checked inline (length or maximum)."""
    kind = column.type
    if isinstance(kind, Money):
        return type(None), 0  # a Decimal: always through the cleaner
    if isinstance(kind, String):
        return str, kind.length if kind.length is not None else 2**63
    if isinstance(kind, Integer):
        return int, _INT_MAX[BigInteger] if isinstance(kind, BigInteger) else _INT_MAX[Integer]
    if isinstance(kind, DateTime):
        return datetime, 0
    if isinstance(kind, Boolean):
        return bool, 0
    return type(None), 0


def _fallback(column: Column[Any]) -> Callable[[], Any]:
    """What a column gets for a missing or unusable value: NULL, its default, or one made up."""
    if column.nullable and not column.primary_key:
        return lambda: None
    if column.default is not None and column.default.is_scalar:
        default = getattr(column.default, "arg", None)
        return lambda: default
    if isinstance(column.type, DateTime):
        return lambda: datetime.now(UTC)
    if column.primary_key:
        return lambda: f"log-{uuid.uuid4().hex}"
    return lambda: 0  # e.g. `status`: 0 reads as "unknown", never as a success


class RowSanitizer:
    """Rows of one table, each value made storable; `__call__` says which fields it had to change."""

    def __init__(self, table: Table | None = None) -> None:
        table = table if table is not None else RequestLog.__table__  # type: ignore[assignment]
        assert table is not None
        # str(): a column's name is a quoted_name, which orjson (the spool) refuses as a key
        self._columns = [(str(c.name), _cleaner(c), _fallback(c), bool(c.nullable)) for c in table.columns]
        self._names = frozenset(name for name, *_ in self._columns)
        # the fast check, grouped by kind so that each loop body is a few comparisons, no call
        self._texts: list[tuple[str, int]] = []
        self._counts: list[tuple[str, int]] = []
        self._typed: list[tuple[str, type]] = []
        self._others: list[tuple[str, Cleaner]] = []
        for column, (name, cleaner, _, _) in zip(table.columns, self._columns, strict=True):
            kind, bound = _fast(column)
            if kind is str:
                self._texts.append((name, bound))
            elif kind is int:
                self._counts.append((name, bound))
            elif kind is datetime or kind is bool:
                self._typed.append((name, kind))
            else:
                self._others.append((name, cleaner))
        self._required = [name for name, _, _, nullable in self._columns if not nullable]

    def __call__(self, row: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
        """The row with every value storable, and the names of the fields whose value was changed.

        A row that needs nothing (the common case: the gateway's own rows) comes back as it is;
        any other comes back as a new dict with exactly the table's columns.
        """
        if self._storable(row):
            return row, []
        clean: dict[str, Any] = {}
        changed: list[str] = []
        for name, cleaner, fallback, nullable in self._columns:
            value = row.get(name)
            if value is None:
                clean[name] = None if nullable else fallback()
                continue
            cleaned = cleaner(value)
            if cleaned is _INVALID:
                cleaned = fallback()
                changed.append(name)
            elif type(cleaned) is _Fixed:
                cleaned = cleaned.value
                changed.append(name)
            clean[name] = cleaned
        if any(name in _USAGE for name in changed):
            clean["cost_estimated"] = True
        return clean, changed

    def _storable(self, row: Mapping[str, Any]) -> bool:
        """Whether every column is there, with a value its column holds as it is (~1/3 of a full pass)."""
        if row.keys() != self._names:
            return False
        get = row.get
        for name, limit in self._texts:
            v = get(name)
            if v is not None and not (type(v) is str and len(v) <= limit and v.isascii() and "\x00" not in v):
                return False
        for name, maximum in self._counts:
            v = get(name)
            if v is not None and not (type(v) is int and 0 <= v <= maximum):
                return False
        for name, kind in self._typed:
            v = get(name)
            if v is not None and type(v) is not kind:
                return False
        for name, cleaner in self._others:
            v = get(name)
            if v is not None and cleaner(v) is not v:
                return False
        return all(get(name) is not None for name in self._required)
