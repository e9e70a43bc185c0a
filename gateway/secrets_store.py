"""The master key and the key-hash secret: from settings, or generated once in dev mode."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from gateway.settings import GatewaySettings

_DEV_FILE = "dev-secrets.json"


@dataclass(frozen=True)
class ServerSecrets:
    """Credentials the gateway needs at run time."""

    master_key: str
    key_secret: bytes


def resolve_secrets(settings: GatewaySettings) -> ServerSecrets:
    """Both secrets (serving): from settings, else generated once in dev mode; MissingSecretsError."""
    settings.require_secrets("master_key", "key_secret")
    master, secret = _value(settings.master_key), _value(settings.key_secret)
    if master and secret:
        return ServerSecrets(master, secret.encode())
    stored = _load_or_create(settings.data_dir / _DEV_FILE)
    return ServerSecrets(master or stored["master_key"], (secret or stored["key_secret"]).encode())


def resolve_key_secret(settings: GatewaySettings) -> bytes:
    """The key secret alone (creating keys needs no master key), as resolve_secrets finds it."""
    settings.require_secrets("key_secret")
    secret = _value(settings.key_secret)
    return (secret or _load_or_create(settings.data_dir / _DEV_FILE)["key_secret"]).encode()


def _value(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None and secret.get_secret_value().strip() else None


def _load_or_create(path: Path) -> dict[str, str]:
    if path.is_file():
        data = json.loads(path.read_text())
        if isinstance(data, dict) and {"master_key", "key_secret"} <= set(data):
            return {k: str(v) for k, v in data.items()}
    data = {"master_key": "sk-master-" + secrets.token_urlsafe(24), "key_secret": secrets.token_hex(32)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    tmp.replace(path)
    return data
