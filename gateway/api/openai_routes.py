"""The OpenAI-compatible routes: chat and text completions, models."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from gateway.auth import KeyInfo, KeyStore
from gateway.errors import GatewayError
from gateway.proxy import MAX_BODY_BYTES, Proxy

router = APIRouter()


async def authenticated_key(request: Request) -> KeyInfo:
    """Dependency: the virtual key in `Authorization: Bearer sk-...` (401/403 otherwise)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" else None
    keys: KeyStore = request.app.state.keys
    return await keys.authenticate(presented or None)


async def proxy(request: Request) -> Proxy:
    """Dependency: the app's Proxy."""
    service: Proxy = request.app.state.proxy
    return service


AuthedKey = Annotated[KeyInfo, Depends(authenticated_key)]
ProxyDep = Annotated[Proxy, Depends(proxy)]


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 as soon as it grows past `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, key: AuthedKey, service: ProxyDep) -> Response:
    """Chat completions, streamed or whole, through the policy's backend for the model."""
    return await service.handle("/v1/chat/completions", await read_body(request), key)


@router.post("/v1/completions")
async def completions(request: Request, key: AuthedKey, service: ProxyDep) -> Response:
    """Text completions, streamed or whole."""
    return await service.handle("/v1/completions", await read_body(request), key)


@router.get("/v1/models")
async def list_models(key: AuthedKey, service: ProxyDep) -> dict[str, Any]:
    """Only the models the calling key may use; unavailable ones say why."""
    data = []
    for name, reason in service.models_for(key):
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "switchboard"}
        if reason is not None:
            entry.update(available=False, unavailable_reason=reason)
        data.append(entry)
    return {"object": "list", "data": data}
