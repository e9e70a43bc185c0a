"""GET /admin/reports/spend (master key): the spend report as JSON or CSV."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Response

from gateway.api.admin_keys import require_master_key
from gateway.api.services import Database
from gateway.errors import GatewayError
from gateway.store.db import DATABASE_ERRORS, unavailable
from gateway.store.reports import Day, Dimension, render, spend

router = APIRouter(prefix="/admin/reports", dependencies=[Depends(require_master_key)])


@router.get("/spend")
async def spend_report(
    db: Database,
    start: Annotated[Day, Query(alias="from")],
    end: Annotated[Day, Query(alias="to")],
    by: Dimension = "key",
    format: Literal["json", "csv"] = "json",
) -> Response:
    """Spend from `from` to `to` (both included, UTC days) grouped `by` key, team, model, backend or day."""
    try:
        rows = await spend(db, start, end, by)
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="to", code="invalid_value") from exc
    except DATABASE_ERRORS as exc:
        raise unavailable("the spend report cannot be read", exc) from exc
    media = "application/json" if format == "json" else "text/csv; charset=utf-8"
    return Response(render(rows, format, by), media_type=media)
