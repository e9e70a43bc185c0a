"""Dev-mode secret files: owner-only from creation, never written through a symlink or overwritten blindly."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli.dev import _dev_key
from gateway.config.private_files import PrivateFileError, create_private, read_private, replace_private
from gateway.config.secrets import resolve_secrets
from gateway.config.settings import GatewaySettings


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """umask 0: a file's mode is exactly what its creator asked for."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _dev_settings(data_dir: Path) -> GatewaySettings:
    return GatewaySettings(dev_mode=True, data_dir=data_dir)


def test_dev_secrets_are_created_owner_only(tmp_path: Path, permissive_umask: None) -> None:
    generated = resolve_secrets(_dev_settings(tmp_path / "data"))
    path = tmp_path / "data" / "dev-secrets.json"
    assert _mode(path) == 0o600 and stat.S_ISREG(path.lstat().st_mode)
    assert json.loads(path.read_text())["master_key"] == generated.master_key
    assert [p.name for p in path.parent.iterdir()] == ["dev-secrets.json"]  # no temporary file left
    assert resolve_secrets(_dev_settings(tmp_path / "data")) == generated  # read back, not regenerated


def test_a_symlink_at_the_dev_secrets_path_is_refused_not_followed(tmp_path: Path) -> None:
    planted = tmp_path / "attacker.json"  # secrets someone else chose
    planted.write_text(json.dumps({"master_key": "sk-master-known", "key_secret": "known"}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dev-secrets.json").symlink_to(planted)
    with pytest.raises(PrivateFileError, match="symbolic link"):
        resolve_secrets(_dev_settings(tmp_path / "data"))


def test_a_symlink_planted_at_a_temporary_name_receives_no_secret(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (data / "dev-secrets.tmp").symlink_to(victim)  # the old code wrote through this name
    resolve_secrets(_dev_settings(data))
    assert victim.read_text() == "precious"
    assert not (data / "dev-secrets.json").is_symlink()


def test_a_dev_secrets_file_that_holds_something_else_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "dev-secrets.json"
    path.write_text("not the secrets")
    with pytest.raises(PrivateFileError, match="remove it"):
        resolve_secrets(_dev_settings(tmp_path))
    assert path.read_text() == "not the secrets"


def test_create_private_never_replaces_what_is_there(tmp_path: Path, permissive_umask: None) -> None:
    path = tmp_path / "secret"
    assert create_private(path, "first") is True
    assert create_private(path, "second") is False  # a concurrent creator: the first one wins
    assert read_private(path) == "first" and _mode(path) == 0o600
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")  # even a dangling symlink is left alone
    assert create_private(link, "x") is False and not (tmp_path / "nowhere").exists()


def test_the_dev_key_file_is_owner_only_from_creation_without_a_chmod(
    tmp_path: Path, permissive_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    chmods: list[object] = []
    monkeypatch.setattr(Path, "chmod", lambda self, mode: chmods.append((self, mode)))
    key = asyncio.run(_dev_key(_dev_settings(tmp_path)))
    path = tmp_path / "dev-key.json"
    assert json.loads(path.read_text()) == {"key": key}
    assert _mode(path) == 0o600 and chmods == []  # never world-readable, not even for a moment
    assert asyncio.run(_dev_key(_dev_settings(tmp_path))) == key  # kept while it works


def test_a_symlinked_dev_key_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"key": "sk-not-a-key"}))
    (tmp_path / "dev-key.json").symlink_to(victim)
    with pytest.raises(PrivateFileError, match="symbolic link"):
        asyncio.run(_dev_key(_dev_settings(tmp_path)))
    assert json.loads(victim.read_text()) == {"key": "sk-not-a-key"}


def test_replace_private_swaps_a_symlink_itself_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "secret"
    path.symlink_to(victim)
    replace_private(path, "new")
    assert victim.read_text() == "precious" and not path.is_symlink() and path.read_text() == "new"
