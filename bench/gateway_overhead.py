"""Gateway overhead, in one run: direct to a fast fake upstream vs our gateway vs LiteLLM proxy.

All three answer the same requests from the same raw-asyncio fake upstream
(tests/fakes/fast_upstream.py), driven by the same lean load generator (bench/loadgen.py).
Each proxy runs one worker: ours with auth (a virtual key), routing and the request log on
(SQLite), LiteLLM proxy with its master key. LiteLLM proxy is installed by this script into its
own virtualenv (bench/.venvs/litellm-proxy, pinned below), since it pins other versions than ours.

For non-streamed and streamed requests: latency at concurrency 1 (p50/p99; "added" = proxy minus
direct), time to the first streamed chunk, and requests/s and p99 at concurrency 32. Then the
issue's targets, each with its verdict.

Usage: python bench/gateway_overhead.py [--seconds 8] [--no-litellm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Results, build_request, run  # noqa: E402
from tests.engine.server_proc import ManagedServer  # noqa: E402
from tests.gateway.processes import create_key_cli, start_gateway  # noqa: E402

LITELLM_PINS = ["litellm[proxy]==1.83.0", "prisma==0.15.0"]
LITELLM_VENV = ROOT / "bench" / ".venvs" / "litellm-proxy"
LITELLM_MASTER = "sk-bench-master"
MESSAGES = [{"role": "user", "content": "one two three four five"}]


@dataclass
class Target:
    """One way to reach the upstream."""

    name: str
    url: str
    headers: dict[str, str]


@dataclass
class Figures:
    """What one target measured (ms and requests/s)."""

    p50: float
    p99: float
    first_p50: float
    rps32: float
    p99_32: float


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def measure(target: Target, stream: bool, seconds: float) -> Figures:
    """Warm up, then concurrency 1 and concurrency 32, each for up to `seconds`."""
    body = json.dumps({"model": "fast", "messages": MESSAGES, "stream": stream}).encode()
    raw = build_request(target.url, body, target.headers)
    warm = uvloop.run(run(target.url, raw, 200, 4, seconds=2))
    if warm.errors:
        raise RuntimeError(f"{target.name}: {warm.errors} errors during warm-up")
    one: Results = uvloop.run(run(target.url, raw, 3000, 1, seconds=seconds))
    many: Results = uvloop.run(run(target.url, raw, 40_000, 32, seconds=seconds))
    for label, results in (("c=1", one), ("c=32", many)):
        if results.errors:
            raise RuntimeError(f"{target.name} {label}: {results.errors} non-200 answers")
    totals = [t.total for t in one.timings]
    return Figures(
        pct(totals, 0.5), pct(totals, 0.99), pct([t.first for t in one.timings], 0.5),
        many.rps, pct([t.total for t in many.timings], 0.99),
    )  # fmt: skip


def fake_and_gateway(
    root: Path, servers: list[ManagedServer], *fake_args: str, more: dict[str, str] | None = None
) -> tuple[ManagedServer, ManagedServer, str]:
    """The fast fake upstream (started with `fake_args`), one gateway worker whose policy serves it
    as `fast` (SQLite request log under `root`), and a virtual key; both appended to `servers`.
    `more`: other models of the policy, each served by an upstream already running at its URL."""
    upstream = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port), *fake_args]
    )
    servers.append(upstream)
    urls = {"fast": upstream.base_url, **(more or {})}
    policy = root / "policy.yaml"
    policy.write_text(
        "backends:\n" + "".join(f'  {m}: {{type: engine, urls: ["{u}"]}}\n' for m, u in urls.items())
        + "models:\n" + "".join(f"  {m}: {{backend: {m}}}\n" for m in urls)
    )  # fmt: skip
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
    gateway = start_gateway(policy, env)
    servers.append(gateway)
    return upstream, gateway, create_key_cli(env, "bench")


def litellm_python() -> Path:
    """The LiteLLM proxy virtualenv's python, created and installed on first use."""
    python = LITELLM_VENV / "bin" / "python"
    stamp = LITELLM_VENV / ".installed"
    if not stamp.exists() or stamp.read_text() != " ".join(LITELLM_PINS):
        print(f"installing {' '.join(LITELLM_PINS)} into {LITELLM_VENV} (once) ...", flush=True)
        venv.create(LITELLM_VENV, with_pip=True, clear=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *LITELLM_PINS], check=True)
        stamp.write_text(" ".join(LITELLM_PINS))
    return python


def start_litellm(root: Path, upstream: str) -> ManagedServer:
    config = root / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: fast\n    litellm_params:\n      model: openai/fast\n"
        f"      api_base: {upstream}/v1\n      api_key: fake-key\n"
        f"general_settings:\n  master_key: {LITELLM_MASTER}\n"
    )
    binary = litellm_python().parent / "litellm"
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    return ManagedServer(
        lambda port: [str(binary), "--config", str(config), "--port", str(port), "--num_workers", "1"],
        180, env, health_path="/health/liveliness",
    )  # fmt: skip


def report(results: dict[str, dict[bool, Figures]]) -> None:
    for stream in (False, True):
        print(f"\n{'streamed' if stream else 'non-streamed'}:")
        print(f"{'':>9} {'c=1 p50':>9} {'c=1 p99':>9} {'1st chunk':>9} {'c=32 req/s':>11} {'c=32 p99':>9}")
        for name, by_mode in results.items():
            f = by_mode[stream]
            print(f"{name:>9} {f.p50:9.3f} {f.p99:9.3f} {f.first_p50:9.3f} {f.rps32:11.0f} {f.p99_32:9.2f}")
        d = results["direct"][stream]
        for name in [n for n in results if n != "direct"]:
            f = results[name][stream]
            print(f"  {name} adds (c=1): p50 {f.p50 - d.p50:.3f} ms, p99 {f.p99 - d.p99:.3f} ms, "
                  f"first chunk {f.first_p50 - d.first_p50:.3f} ms")  # fmt: skip


def verdicts(results: dict[str, dict[bool, Figures]]) -> None:
    d, g = results["direct"], results["gateway"]
    checks = [
        ("added p50 at c=1 <= 0.75 ms", g[False].p50 - d[False].p50, 0.75),
        ("added p99 at c=1 <= 2 ms", g[False].p99 - d[False].p99, 2.0),
        ("added first-chunk time at c=1 <= 1 ms", g[True].first_p50 - d[True].first_p50, 1.0),
    ]
    print("\ntargets:")
    for label, value, limit in checks:
        print(f"  {label:<42} {value:8.3f}  {'met' if value <= limit else 'NOT met'}")
    if "litellm" in results:
        for stream in (False, True):
            lite, ours, kind = results["litellm"][stream], g[stream], "streamed" if stream else "whole"
            ratio = ours.rps32 / lite.rps32
            print(f"  {kind} req/s at c=32 >= 8x LiteLLM's        {ratio:8.1f}x "
                  f"{'met' if ratio >= 8 else 'NOT met'}")  # fmt: skip
            share = ours.p99_32 / lite.p99_32
            print(f"  {kind} p99 at c=32 <= 1/8 of LiteLLM's      {share:8.3f}  "
                  f"{'met' if share <= 1 / 8 else 'NOT met'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measured run")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM proxy")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    servers: list[ManagedServer] = []
    try:
        upstream, gateway, key = fake_and_gateway(root, servers)
        path = "/v1/chat/completions"
        targets = [
            Target("direct", upstream.base_url + path, {}),
            Target("gateway", gateway.base_url + path, {"authorization": f"Bearer {key}"}),
        ]
        if not args.no_litellm:
            litellm = start_litellm(root, upstream.base_url)
            servers.append(litellm)
            targets.append(
                Target("litellm", litellm.base_url + path, {"authorization": f"Bearer {LITELLM_MASTER}"})
            )
        results: dict[str, dict[bool, Figures]] = {}
        for target in targets:
            print(f"measuring {target.name} ...", flush=True)
            results[target.name] = {stream: measure(target, stream, args.seconds) for stream in (False, True)}
        print(f"\none worker each; {os.cpu_count()} CPUs; times in ms")
        report(results)
        verdicts(results)
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    main()
