"""`python -m gateway dev`: the engine and the gateway together on localhost, for `make run`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import yaml

from gateway.config.private_files import read_private, replace_private
from gateway.config.secrets import resolve_secrets
from gateway.config.settings import GatewaySettings
from gateway.governance.keys import AuthError, KeyHasher, KeyStore
from gateway.store.db import create_db, session_factory
from gateway.store.migrate import ensure_schema

_DEV_KEY_FILE = "dev-key.json"
# the repository's default policy, wherever `dev` is run from (it was read relative to the folder)
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"


class DevStackError(RuntimeError):
    """What stops `gateway dev`: said in one line (exit 1)."""


def _free(host: str, port: int) -> None:
    """DevStackError when something listens on the port already: a server answering /health there
    was taken for our engine (its models served as ours), and ours died on "address in use"."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise DevStackError(f"port {port} on {host} is in use ({exc.strerror}): stop what runs there, "
                                "or choose another with --port / --engine-port") from None  # fmt: skip


def _wait_healthy(name: str, proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DevStackError(f"the {name} exited with status {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise DevStackError(f"the {name} was not healthy after {timeout:.0f}s")


async def _dev_key(settings: GatewaySettings) -> str:
    """The dev key kept in the data directory, created (or re-created) when it no longer works."""
    url = settings.resolved_database_url
    await ensure_schema(url, auto_upgrade=True)
    db = create_db(url)
    path = settings.data_dir / _DEV_KEY_FILE
    try:
        store = KeyStore(session_factory(db), KeyHasher(resolve_secrets(settings).key_secret), 0.0)
        text = read_private(path)  # PrivateFileError for a symlink: never followed
        if text is not None:
            try:
                key = str(json.loads(text).get("key", ""))
            except (ValueError, AttributeError):  # not our JSON: a new key replaces it
                key = ""
            try:
                await store.authenticate(key)
                return key
            except AuthError:
                pass
        _, key = await store.create("dev", metadata={"created_by": "python -m gateway dev"})
        replace_private(path, json.dumps({"key": key}))  # mode 0600 from creation, then renamed in place
        return key
    finally:
        await db.dispose()


def _policy_for(
    engine_url: str, model_names: list[str], data_dir: Path, tokenizer: Path | None = None
) -> Path:
    """policies/default.yaml with its engine URLs pointed at this run's engine (and its tokenizer)."""
    policy = yaml.safe_load(DEFAULT_POLICY.read_text())
    for backend in policy["backends"].values():
        if backend.get("type") == "engine":
            backend["urls"] = [engine_url]
            if tokenizer is not None and (tokenizer / "tokenizer.json").is_file():
                backend["tokenizer"] = str(tokenizer)
    engines = [name for name, b in policy["backends"].items() if b.get("type") == "engine"]
    for name, route in policy["models"].items():  # the default policy names the default model
        if route["backend"] in engines and (route.get("model") or name) not in model_names:
            route["model"] = model_names[0]
    for name in model_names:
        policy["models"].setdefault(name, {"backend": engines[0]})
    path = data_dir / "dev-policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def _hosted_lines(policy: Path) -> str:
    """Each hosted model with whether its key is set (from the policy, without importing litellm)."""
    data = yaml.safe_load(policy.read_text())
    lines = []
    for name, route in data["models"].items():
        backend = data["backends"][route["backend"]]
        if backend.get("type") != "hosted":
            continue
        env = backend.get("api_key_env")
        state = "available" if not env or os.environ.get(env) else f"UNAVAILABLE: set {env}"
        lines.append(f"{name} ({backend['model']}): {state}")
    return "\n           ".join(lines) or "none in the policy"


def _banner(gateway_url: str, master_key: str, key: str, models: list[str], hosted: str) -> str:
    model = models[0]
    return f"""
Switchboard is running.
  gateway  {gateway_url}   (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/models)
  models   {", ".join(models)}
  key      {key}
  master   {master_key}   (admin API: {gateway_url}/admin/keys)
  console  {gateway_url}/ui   (log in with the master key)
  hosted   {hosted}

curl {gateway_url}/v1/chat/completions -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{gateway_url}/v1", api_key="{key}")
reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
print(reply.choices[0].message.content)
PY

Ctrl-C stops both.
"""


class _StopRequested(BaseException):
    """SIGINT or SIGTERM arrived: stop both processes and exit 0.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it.
    """


class _StopSignals:
    """The handler of SIGINT, SIGTERM and SIGHUP: counts them; the first, while the stack starts or
    runs, raises _StopRequested (so that a signal during the long start-up stops at once too)."""

    def __init__(self) -> None:
        self.received = 0
        self.stopping = False

    def __call__(self, signum: int, _frame: object) -> None:
        self.received += 1
        if not self.stopping:
            self.stopping = True
            raise _StopRequested(signal.Signals(signum).name)


def _stop_children(procs: list[subprocess.Popen[bytes]], signals: _StopSignals, timeout: float = 60) -> None:
    """SIGTERM to each child, the gateway first; another signal meanwhile sends each a second one,
    and a third kills them (so does `timeout`).

    The second SIGTERM ends the gateway's grace period: its requests in flight are cut off, logged
    and told (503 `gateway_shutdown`). The engine gets its own (which drops its requests at once)
    only when the gateway is gone: before, the gateway's requests would end as upstream failures.
    """
    signals.stopping = True
    # 1 when a signal stopped us (any more came since: a second while the start-up unwound), 0
    # when a child exited by itself
    first = min(signals.received, 1)
    order = list(reversed(procs))  # the gateway, then the engine
    for p in order:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    hurried = 0  # how many of `order` were sent their second SIGTERM
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        time.sleep(0.05)  # first: a second SIGTERM sent while the first is pending merges with it
        if signals.received >= first + 2 or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        if signals.received == first + 1:
            while hurried < len(order) and (hurried == 0 or order[hurried - 1].poll() is not None):
                if order[hurried].poll() is None:
                    order[hurried].send_signal(signal.SIGTERM)
                hurried += 1
    for p in procs:
        p.wait()


def run_dev_stack(
    model: str, port: int, engine_port: int, host: str = "127.0.0.1", engine_options: Sequence[str] = ()
) -> int:
    """Start the engine, then the gateway in dev mode; stop both on Ctrl-C (SIGINT) or SIGTERM.

    Both signals get our own handler: Python installs its KeyboardInterrupt handler only when
    SIGINT was not ignored at start-up, and a background job, `nohup` or a CI runner starts us with
    it ignored. The handler raises, so a signal during the (long) start-up stops at once too.
    Each child runs in a process group of its own: Ctrl-C at the terminal reaches only us, and each
    child gets its SIGTERMs from us. In our group it also got the terminal's SIGINT, and a second
    signal forces uvicorn out without its shutdown (the gateway's queued request-log rows were lost).
    A second Ctrl-C is forwarded as a second SIGTERM (the gateway cuts its requests off, logged),
    a third kills both (_stop_children). The terminal closing (SIGHUP) stops both the same way.
    """
    settings = GatewaySettings(dev_mode=True)
    gateway_env = {**os.environ, "GATEWAY_DEV_MODE": "1"}  # the child's environment; ours is unchanged
    engine_url, gateway_url = f"http://{host}:{engine_port}", f"http://{host}:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    signals = _StopSignals()
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signals)
    try:
        for free in (engine_port, port):  # before the engine's long start, not after
            _free(host, free)
        engine_cmd = [sys.executable, "-m", "engine", "serve", "--model", model, "--host", host,
                      "--port", str(engine_port), "--no-access-log", *engine_options]  # fmt: skip
        procs.append(subprocess.Popen(engine_cmd, process_group=0))
        print(f"starting the engine ({model}) on {engine_url} ...", flush=True)
        _wait_healthy("engine", procs[0], engine_url, timeout=900)
        served = [m["id"] for m in httpx.get(f"{engine_url}/v1/models", timeout=10).json()["data"]]
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        from engine.default_model import resolve_model  # the engine resolved the same name already

        policy = _policy_for(engine_url, served, settings.data_dir, resolve_model(model))
        key = asyncio.run(_dev_key(settings))
        gateway_cmd = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--host", host,
                       "--port", str(port)]  # fmt: skip
        procs.append(subprocess.Popen(gateway_cmd, env=gateway_env, process_group=0))
        _wait_healthy("gateway", procs[1], gateway_url, timeout=120)
        exposed = yaml.safe_load(policy.read_text())
        models = [*exposed["models"], *(exposed.get("routes") or {})]
        master = resolve_secrets(settings).master_key
        print(_banner(gateway_url, master, key, models, _hosted_lines(policy)), flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.2)
        gone = next(
            name for name, p in zip(("engine", "gateway"), procs, strict=True) if p.poll() is not None
        )
        raise DevStackError(
            f"the {gone} exited by itself (status {procs[0 if gone == 'engine' else 1].returncode})"
        )
    except DevStackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except _StopRequested:
        return 0
    finally:
        _stop_children(procs, signals, settings.shutdown_timeout + 30)  # the gateway's grace, then some
