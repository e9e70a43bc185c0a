"""GET /admin/policy (master key): the active policy version, the last refused change, backend health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.api.admin_keys import require_master_key
from gateway.pipeline.runtime import PolicyWatcher

router = APIRouter(prefix="/admin/policy", dependencies=[Depends(require_master_key)])


@router.get("")
async def policy_status(request: Request) -> dict[str, Any]:
    """Active version hash and load time, the last reload error (if any), each backend's replicas."""
    watcher: PolicyWatcher = request.app.state.policy_watcher
    return watcher.status()
