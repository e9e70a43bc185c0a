"""Start `python -m engine serve` in a subprocess on a free port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A server subprocess on a free port, ready once GET `health_path` answers 200.

    `command(port)` builds its command line (`port`: a given one, e.g. to restart a server where it
    was; default a free one); `stop()` sends SIGTERM and returns the exit code. `process_group`:
    the server leads a process group of its own (its children, say, can be signalled together).
    """

    def __init__(
        self,
        command: Callable[[int], list[str]],
        ready_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        port: int | None = None,
        process_group: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.health_path = health_path
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            command(self.port), stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
            process_group=0 if process_group else None,
        )  # fmt: skip
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}{self.health_path}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start-up is seconds: ready within 50 ms of it
        self.proc.kill()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        """Everything the server printed so far."""
        return Path(self.log.name).read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send a signal to the server."""
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait, return the exit code (kills it if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ManagedServer):
    """`python -m engine serve` with the given model and options.

    `hooks=True`: `python -m tests.engine.hooked_server serve`, the same server with test hooks
    (POST /debug/stall, /debug/fail-steps); run from the repository root.
    """

    def __init__(
        self,
        model: str | Path,
        *args: str,
        ready_timeout: float = 180.0,
        port: int | None = None,
        env: dict[str, str] | None = None,
        hooks: bool = False,
    ) -> None:
        def command(port: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "tests.engine.hooked_server" if hooks else "engine",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                *args,
            ]

        super().__init__(command, ready_timeout, env, port=port)

    def metrics(self) -> dict[str, float]:
        """/metrics as {series: value}, labels dropped (one model per server)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            if "finished_reason=" in labels:
                name += "[" + labels.split('finished_reason="')[1].split('"')[0] + "]"
            if 'le="' in labels:
                continue
            values[name] = float(value)
        return values
