"""The OpenAI-compatible routes on FastAPI: models (completions: gateway/api/completions.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway.api.services import Keys, ProxyDep
from gateway.errors import model_not_found
from gateway.governance.keys import KeyInfo

router = APIRouter()


async def authenticated_key(request: Request, keys: Keys) -> KeyInfo:
    """Dependency: the key in `Authorization: Bearer sk-...` (else 401/403; 503 if the database is down)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" else None
    return await keys.authenticate(presented or None, request.client)


AuthedKey = Annotated[KeyInfo, Depends(authenticated_key)]


@router.get("/v1/models")
async def list_models(key: AuthedKey, service: ProxyDep) -> dict[str, Any]:
    """Only the models the calling key may use; unavailable ones say why."""
    return {"object": "list", "data": [_entry(name, reason) for name, reason in service.models_for(key)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, key: AuthedKey, service: ProxyDep) -> dict[str, Any]:
    """One model the calling key may use (`client.models.retrieve`); any other is 404, as OpenAI
    answers for a model that does not exist or that the caller may not use."""
    for name, reason in service.models_for(key):
        if name == model:
            return _entry(name, reason)
    raise model_not_found(model)


def _entry(name: str, reason: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "switchboard"}
    if reason is not None:
        entry.update(available=False, unavailable_reason=reason)
    return entry
