"""Files that hold secrets (dev mode's generated master key, key secret and dev key): owner-only from birth.

A file is never written and then chmod'ed (someone may open it in between), and never written
through a symlink (someone with write access to the folder could point it at a file of ours).
New content goes into a fresh temporary file created with O_CREAT|O_EXCL|O_NOFOLLOW and mode
0600, then takes its name atomically: `os.link` when the name must be new (it fails if anything,
a symlink included, is there already), `os.replace` when an old regular file is replaced (a
rename replaces a symlink itself, never its target). Readers never see a half-written file.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateFileError(RuntimeError):
    """A secret file is a symlink or not a regular file, or holds something else: it is left alone."""


def read_private(path: Path) -> str | None:
    """The file's text; None if there is none. PrivateFileError for a symlink or a non-regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PrivateFileError(
                f"{path} is a symbolic link: a secret file is never followed; remove it"
            ) from exc
        raise
    with os.fdopen(fd, encoding="utf-8") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise PrivateFileError(f"{path} is not a regular file; remove it")
        if mode & 0o077:
            logger.warning(
                "%s holds secrets but is readable by others (mode %o): chmod 600 it", path, mode & 0o777
            )
        return f.read()


def create_private(path: Path, text: str) -> bool:
    """Write `text` to `path`, which must not exist yet; False if something is there already (left as is)."""
    return _place(path, text, replace=False)


def replace_private(path: Path, text: str) -> None:
    """Write `text` to `path`, replacing what is there (a symlink is replaced itself, not followed)."""
    _place(path, text, replace=True)


def _place(path: Path, text: str, replace: bool) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _NEW, 0o600)  # 0600 from creation (a umask can only take bits away)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)
