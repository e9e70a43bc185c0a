"""`make run`: Ctrl-C at the terminal stops it with exit status 0 and no error from make.

Ctrl-C sends SIGINT to the terminal's foreground process group. GNU make, when SIGINT reaches it,
waits for its children and then kills itself with SIGINT (status 130), whatever they returned.
The recipe gives `gateway dev` a process group of its own and the terminal (the shell's job
control) so that only it gets Ctrl-C. A stand-in for the venv's Python keeps the test fast: it
behaves as `gateway dev` does on SIGINT (exit 0).
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shutil
import signal
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = """#!/bin/sh
echo $$ > "$(dirname "$0")/pid"
trap 'echo stopped; exit 0' INT
echo up
for _ in $(seq 600); do sleep 0.1; done
"""


def _read_until(fd: int, text: bytes, seconds: float) -> bytes:
    out, deadline = b"", time.monotonic() + seconds
    while text not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed: everyone exited
                break
            if not chunk:
                break
            out += chunk
    return out


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_ctrl_c_in_make_run_exits_0_without_an_error_from_make(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    pid, fd = pty.fork()
    if pid == 0:  # the child: make on a terminal, `model` taken as made
        # as a login shell starts it: SIGINT at its default, even when this test runs in a
        # background job (which ignores SIGINT, and a shell cannot trap what it inherits ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(ROOT)
        os.execvp("make", ["make", "-o", "model", "run", f"PY={python}"])
    try:
        out = _read_until(fd, b"up", 30)
        assert b"up" in out, out
        os.write(fd, b"\x03")  # Ctrl-C: the terminal signals its foreground process group
        out += _read_until(fd, b"\0", 10)
        waited, status = 0, 0
        deadline = time.monotonic() + 10
        while waited == 0 and time.monotonic() < deadline:
            waited, status = os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        assert waited == pid, out
        assert os.waitstatus_to_exitcode(status) == 0, out
        assert b"stopped" in out and b"***" not in out, out
    finally:
        _kill_group(pid)  # pty.fork made make a session (and group) leader
        if (tmp_path / "pid").exists():  # the stand-in's group: its own with the recipe's job control
            _kill_group(int((tmp_path / "pid").read_text()))
        os.close(fd)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
