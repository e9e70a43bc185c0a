"""LogSpool: request-log rows kept on local disk while the database is away, read back when it returns.

The spool is a folder (mode 0700) of segment files (mode 0600), one per spill: JSON lines, one
row per line, written under a temporary name, fsync'd, then renamed, so a segment is either whole
or absent (a crash mid-spill loses only what was still in memory anyway). Names start with the
time in nanoseconds, so listing them in name order replays them in the order they were spilled.

Several gateway processes may share the folder: a segment is read whole and removed only after
its rows are in the database, and the insert skips rows whose id is already there, so two
processes replaying the same segment, or a crash between the insert and the removal, never
write a row twice. Total size is bounded by `max_bytes`: rows past it are not kept (the caller
counts them as dropped).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.engine import make_url

logger = logging.getLogger(__name__)

_SUFFIX = ".jsonl"
_PARTIAL = ".partial"
_STALE_PARTIAL_S = 60.0  # a spill takes well under this: an older partial file is a crashed spill


@dataclass(frozen=True)
class SpoolRead:
    """One segment read back: its rows, and how many lines could not be parsed."""

    rows: list[dict[str, Any]]
    unreadable: int


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)  # exact; the sanitizer turns it back into a Decimal
    raise TypeError(f"cannot spool a {type(value).__name__}")


class LogSpool:
    """Segments of spilled rows in `directory`, at most `max_bytes` in all. Blocking: run in a thread."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._sequence = 0

    @classmethod
    def for_database(cls, directory: Path, database_url: str, max_bytes: int) -> LogSpool:
        """The spool of one database: a subfolder named after its URL (password left out), so a
        gateway pointed at another database never replays rows into the wrong one."""
        identity = make_url(database_url).set(password=None).render_as_string(hide_password=False)
        return cls(directory / hashlib.sha256(identity.encode()).hexdigest()[:16], max_bytes)

    def _ensure_directory(self) -> None:
        if not self.directory.is_dir():
            self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.directory.mkdir(mode=0o700, exist_ok=True)

    def segments(self) -> list[Path]:
        """The segments waiting to be replayed, oldest first.

        A partial file left by a process that died mid-spill is included once it is stale: its
        whole lines are rows like any other (a cut last line is counted as unreadable).
        """
        stale = time.time() - _STALE_PARTIAL_S
        names: list[str] = []
        try:
            for entry in os.scandir(self.directory):
                whole = entry.name.endswith(_SUFFIX)
                if whole or (entry.name.endswith(_SUFFIX + _PARTIAL) and _mtime(entry) < stale):
                    names.append(entry.name)
        except FileNotFoundError:
            return []
        return [self.directory / name for name in sorted(names)]

    def size(self) -> int:
        """Bytes held by the spool's files (partial ones included: they count against the bound)."""
        total = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # removed by another process meanwhile
                continue
        return total

    def append(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Write the rows as one new segment, as many as fit under `max_bytes`; returns how many."""
        room = self.max_bytes - self.size()
        lines: list[bytes] = []
        for row in rows:
            line = orjson.dumps(row, default=_default) + b"\n"
            if len(line) > room:
                break  # the oldest rows are kept, the newest are the ones over the bound
            room -= len(line)
            lines.append(line)
        if not lines:
            return 0
        self._ensure_directory()
        self._sequence += 1
        name = f"{time.time_ns():020d}-{os.getpid()}-{self._sequence:06d}{_SUFFIX}"
        partial = self.directory / (name + _PARTIAL)
        # O_EXCL: never write through a file or link someone else put there; 0600: rows hold key
        # ids, teams and (when the policy logs them) prompts
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"".join(lines))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, self.directory / name)
        self._sync_directory()  # the rename itself survives a power cut
        return len(lines)

    def read(self, segment: Path) -> SpoolRead:
        """A segment's rows (an empty read if another process already replayed and removed it)."""
        try:
            data = segment.read_bytes()
        except FileNotFoundError:
            return SpoolRead([], 0)
        rows: list[dict[str, Any]] = []
        unreadable = 0
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                unreadable += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                unreadable += 1
        return SpoolRead(rows, unreadable)

    def remove(self, segment: Path) -> None:
        """Forget a segment whose rows are all in the database."""
        segment.unlink(missing_ok=True)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
