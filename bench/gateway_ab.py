"""Two versions of the gateway side by side in one run: a commit's against the working tree.

Both serve the same paced fake upstream (bench/stream_relay.py's: a role chunk, then one word per
chunk GAP ms apart), each its own worker process and SQLite log. Measured in alternation, so
that a noisy machine's drift hits both alike:
- at concurrency 1 (httpx, line by line): the first chunk that carries text, added over direct;
- at concurrency 4, for rounds of S seconds each: each process's CPU (user + system) per relayed
  chunk (streams) and per whole request.

Usage: python bench/gateway_ab.py OLD_COMMIT [--requests 150] [--seconds 3] [--rounds 3] [--gap-ms 5]
       [--tokens 20]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_relay import PATH, Target, cpu_seconds, load, pct, stream_once  # noqa: E402
from tests.engine.server_proc import ManagedServer  # noqa: E402
from tests.gateway.processes import create_key_cli, gateway_cli  # noqa: E402


def tree_of(commit: str, into: Path) -> Path:
    """The gateway package of `commit`, with links to this checkout's migrations and policies."""
    archive = subprocess.run(["git", "archive", commit, "gateway"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    for shared in ("migrations", "policies"):
        (into / shared).symlink_to(ROOT / shared)
    return into


def start(name: str, tree: Path, policy: Path, root: Path, servers: list[ManagedServer]) -> Target:
    """One gateway worker importing its code from `tree` (first on sys.path), and a key for it."""
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / (name + '.db')}"}  # fmt: skip
    gateway_cli(env, "db", "upgrade")
    boot = (f"import sys; sys.path.insert(0, {str(tree)!r}); import runpy; "
            "runpy.run_module('gateway', run_name='__main__', alter_sys=True)")  # fmt: skip
    server = ManagedServer(
        lambda port: [sys.executable, "-c", boot, "serve", "--policy", str(policy), "--port", str(port)],
        60,
        env,
    )
    servers.append(server)
    key = create_key_cli(env, name)
    return Target(name, server.base_url + PATH, {"authorization": f"Bearer {key}"}, server)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", help="the commit to compare the working tree's gateway with")
    parser.add_argument("--requests", type=int, default=150, help="streams per gateway at concurrency 1")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each CPU round")
    parser.add_argument("--rounds", type=int, default=3, help="CPU rounds per gateway")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="upstream gap between events")
    parser.add_argument("--tokens", type=int, default=20,
                        help="text chunks per stream (long streams: the per-chunk cost alone)")  # fmt: skip
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gateway-ab-"))
    servers: list[ManagedServer] = []
    try:
        fake = [
            sys.executable,
            "tests/fakes/fast_upstream.py",
            "--gap-ms",
            str(args.gap_ms),
            "--tokens",
            str(args.tokens),
        ]
        upstream = ManagedServer(lambda port: [*fake, "--port", str(port)])
        servers.append(upstream)
        policy = root / "policy.yaml"
        policy.write_text(f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
                          "models:\n  fast: {backend: fake}\n")  # fmt: skip
        old = start("old", tree_of(args.old, root / "old"), policy, root, servers)
        new = start("new", ROOT, policy, root, servers)
        direct = Target("direct", upstream.base_url + PATH, {}, None)
        targets = [direct, old, new]
        first_text: dict[str, list[float]] = {t.name: [] for t in targets}
        clients = {t.name: httpx.Client(timeout=30) for t in targets}
        order = random.Random(0)
        for i in range(args.requests + 20):  # the first 20: warm-up
            # in a new order each time: one that never changed gave the gateway measured last
            # 0.1-0.4 ms more than the same code measured first (a loaded 2-core VM)
            for t in order.sample(targets, len(targets)):
                timing = stream_once(clients[t.name], t)
                if i >= 20:
                    first_text[t.name].append(timing.first_text)
        base = pct(first_text["direct"], 0.5)
        print(f"old = {args.old}, new = the working tree; upstream chunks {args.gap_ms:g} ms apart")
        for t in (old, new):
            print(f"  {t.name}: first text chunk adds {pct(first_text[t.name], 0.5) - base:.3f} ms (p50)")
        for stream in (True, False):
            spent = {t.name: [0.0, 0] for t in (old, new)}
            for _ in range(args.rounds):
                for t in (old, new):
                    assert t.server is not None
                    before = cpu_seconds(t.server)
                    requests, chunks = load(t, stream, 4, args.seconds)
                    spent[t.name][0] += cpu_seconds(t.server) - before
                    spent[t.name][1] += chunks if stream else requests
            unit = "relayed chunk (all of a stream's CPU)" if stream else "whole request"
            for name, (cpu, count) in spent.items():
                print(f"  {name}: {cpu / count * 1e3:.3f} ms CPU per {unit} ({count:.0f})")
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    main()
