"""GET /admin/policy (master key): the active policy version, the last refused change, backend health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.api.admin_keys import require_master_key
from gateway.api.services import Watcher

router = APIRouter(prefix="/admin/policy", dependencies=[Depends(require_master_key)])


@router.get("")
async def policy_status(watcher: Watcher) -> dict[str, Any]:
    """Active version hash and load time, the last reload error (if any), each backend's replicas."""
    return watcher.status()
