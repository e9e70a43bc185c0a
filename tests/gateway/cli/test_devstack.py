"""`python -m gateway dev` (what `make run` starts): engine and gateway up, a working key, clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.engine.server_proc import free_port


def test_dev_stack_serves_through_the_gateway_and_stops_on_sigint(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    port, engine_port = free_port(), free_port()
    env = dict(os.environ, GATEWAY_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    for name in ("GATEWAY_MASTER_KEY", "GATEWAY_KEY_SECRET", "GATEWAY_DATABASE_URL"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "gateway", "dev", "--model", str(tiny_chat_model), "--port", str(port),
           "--engine-port", str(engine_port)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while "Ctrl-C stops both." not in out:
            assert time.monotonic() < deadline and proc.poll() is None, out
            out += proc.stdout.readline()
        key = re.search(r"^\s+key\s+(sk-\S+)", out, re.M)
        example = re.search(r'"model": "([^"]+)"', out)  # the model the printed examples use
        assert key is not None and example is not None, out
        for model in {tiny_chat_model.name, example.group(1)}:
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                headers={"Authorization": f"Bearer {key.group(1)}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    for p in (port, engine_port):
        try:
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
            raise AssertionError(f"something still listens on {p}")
        except httpx.TransportError:
            pass
