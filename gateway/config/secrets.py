"""The master key and the key-hash secret: from settings, or generated once in dev mode."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from gateway.config.private_files import PrivateFileError, create_private, read_private
from gateway.config.settings import GatewaySettings

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
    """The dev secrets kept at `path`, generated there (mode 0600 from creation) the first time.

    Two processes starting at once agree: the second to create finds the first one's file and uses
    it. A file that does not hold the two secrets, a symlink, or anything but a regular file is
    never overwritten: PrivateFileError says to remove it.
    """
    text = read_private(path)
    if text is None:
        fresh = {"master_key": "sk-master-" + secrets.token_urlsafe(24), "key_secret": secrets.token_hex(32)}
        if create_private(path, json.dumps(fresh)):
            return fresh
        text = read_private(path)  # another process created it first
        assert text is not None, path
    data: object
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not {"master_key", "key_secret"} <= set(data):
        raise PrivateFileError(f"{path} does not hold the dev secrets; remove it to generate new ones")
    return {k: str(v) for k, v in data.items()}
