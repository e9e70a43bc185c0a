"""gateway/store/record.py: one set of defaults, exactly the request log's columns."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.store.models import RequestLog
from gateway.store.record import LogRow, blank_row
from gateway.store.row_sanitizer import RowSanitizer


def test_a_blank_row_has_exactly_the_request_log_columns_and_is_stored_as_it_is() -> None:
    row = blank_row("req-1", datetime.now(UTC), 401, 0.25)
    assert set(row) == {str(c.name) for c in RequestLog.__table__.columns} == set(LogRow.__annotations__)
    clean, changed = RowSanitizer()(row)
    assert clean is row and changed == []  # the sanitizer's fast path: nothing to clean
