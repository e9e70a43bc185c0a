"""Admin API for virtual keys (master key only): create, list, get, update, revoke, rotate."""

from __future__ import annotations

import hmac
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import AuthError, KeyStore

router = APIRouter(prefix="/admin/keys")


async def require_master_key(request: Request) -> None:
    """Dependency: `Authorization: Bearer <master key>`, compared in constant time."""
    expected: str = request.app.state.secrets.master_key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(
            401, "Missing master key: send 'Authorization: Bearer <master key>'", "missing_api_key"
        )
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthError(403, "The admin API needs the master key", "not_master_key")


async def key_store(request: Request) -> KeyStore:
    """Dependency: the app's KeyStore."""
    store: KeyStore = request.app.state.keys
    return store


Keys = Annotated[KeyStore, Depends(key_store)]


class KeyCreate(BaseModel):
    """POST /admin/keys."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    team: str | None = Field(None, min_length=1, max_length=200)
    allowed_models: list[str] | None = None
    expires_at: datetime | None = None
    expires_in_days: float | None = Field(None, gt=0)
    metadata: dict[str, Any] = Field(default_factory=dict)
    rpm_limit: int | None = Field(None, ge=1)
    tpm_limit: int | None = Field(None, ge=1)
    budget_usd: Decimal | None = Field(None, gt=0, max_digits=20, decimal_places=12)
    budget_period: Literal["daily", "weekly", "monthly", "total"] = "monthly"

    def expiry(self) -> datetime | None:
        """Absolute expiry from either field."""
        if self.expires_in_days is not None:
            return datetime.now(UTC) + timedelta(days=self.expires_in_days)
        return self.expires_at


class KeyUpdate(BaseModel):
    """PATCH /admin/keys/{id}: only the fields given change."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, min_length=1, max_length=200)
    team: str | None = Field(None, min_length=1, max_length=200)
    allowed_models: list[str] | None = None
    expires_at: datetime | None = None
    metadata: dict[str, Any] | None = None
    rpm_limit: int | None = Field(None, ge=1)
    tpm_limit: int | None = Field(None, ge=1)
    budget_usd: Decimal | None = Field(None, gt=0, max_digits=20, decimal_places=12)
    budget_period: Literal["daily", "weekly", "monthly", "total"] | None = None


admin = [Depends(require_master_key)]


@router.post("", status_code=201, dependencies=admin)
async def create_key(body: KeyCreate, keys: Keys) -> dict[str, Any]:
    """Create a key; the plaintext `key` is in this response only."""
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
async def list_keys(keys: Keys, team: str | None = None, include_revoked: bool = True) -> dict[str, Any]:
    """Every key (never a plaintext), newest first."""
    return {"object": "list", "data": [k.public() for k in await keys.list(team, include_revoked)]}


@router.get("/{key_id}", dependencies=admin)
async def get_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """One key."""
    return (await keys.get(key_id)).public()


@router.patch("/{key_id}", dependencies=admin)
async def update_key(key_id: str, body: KeyUpdate, keys: Keys) -> dict[str, Any]:
    """Change name, team, allowed models, expiry or metadata."""
    fields = body.model_dump(exclude_unset=True)
    return (await keys.update(key_id, **fields)).public()


@router.post("/{key_id}/revoke", dependencies=admin)
async def revoke_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """Stop the key (every replica within the key cache TTL)."""
    return (await keys.revoke(key_id)).public()


@router.post("/{key_id}/rotate", dependencies=admin)
async def rotate_key(key_id: str, keys: Keys) -> dict[str, Any]:
    """Replace the key's secret; the new plaintext `key` is in this response only."""
    info, plaintext = await keys.rotate(key_id)
    return {**info.public(), "key": plaintext}
