"""Gateway overhead as wrk sees it, in one run: direct to the fake upstream vs through our gateway.

An independent harness measures the gateway with wrk (keep-alive connections, one request after
another on each, latency to the answer's last byte) against a raw fake upstream. This script does
the same, with `wrk` from the PATH (Debian's `apt-get install wrk`; absent: it says so and exits 0):
- whole answers at concurrency 1 (added p50 / p99) and 32 (requests/s), from the fast fake
  (tests/fakes/fast_upstream.py, no pacing);
- streams at concurrency 1: unpaced (the stream's events in one write), and paced like a model
  (`--gap-ms` between events, `--tokens` text chunks), where wrk's latency is the whole stream's.
Each figure alternates direct and gateway `--rounds` times (this machine is noisy) and prints the
median round. LiteLLM proxy can run beside ours (`--litellm`, installed by gateway_overhead.py).

Usage: python bench/wrk_overhead.py [--seconds 5] [--rounds 3] [--litellm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import LITELLM_MASTER, fake_and_gateway, start_litellm  # noqa: E402
from tests.engine.server_proc import ManagedServer  # noqa: E402

PATH = "/v1/chat/completions"
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


@dataclass
class Run:
    """What one wrk run measured: latency percentiles (ms) and requests/s."""

    p50: float
    p99: float
    rps: float


def script(root: Path, name: str, headers: dict[str, str], stream: bool) -> Path:
    """A wrk Lua script that POSTs one chat completion with `headers`."""
    body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "one two three"}],
                       "stream": stream})  # fmt: skip
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body)}",
             'wrk.headers["Content-Type"] = "application/json"']  # fmt: skip
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    path = root / f"{name}-{'stream' if stream else 'whole'}.lua"
    path.write_text("\n".join(lines) + "\n")
    return path


def wrk(url: str, lua: Path, connections: int, seconds: float) -> Run:
    """One wrk run (one thread per two connections, at most two threads); its percentiles parsed."""
    threads = max(1, min(2, connections // 2))
    out = subprocess.run(
        ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s", "--latency",
         "-s", str(lua), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors against {url}:\n{out}")
    found = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+(?:us|ms|s))$", out, re.M))
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    if len(found) < 2 or rps is None:
        raise RuntimeError(f"wrk's output not understood:\n{out}")
    return Run(_ms(found["50"]), _ms(found["99"]), float(rps.group(1)))


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS[unit]


def rounds(targets: dict[str, tuple[str, Path]], connections: int, seconds: float, n: int) -> dict[str, Run]:
    """Each target measured `n` times, in alternation; the round with the median p50 of each."""
    runs: dict[str, list[Run]] = {name: [] for name in targets}
    for _ in range(n):
        for name, (url, lua) in targets.items():
            runs[name].append(wrk(url, lua, connections, seconds))
    return {name: sorted(rs, key=lambda r: r.p50)[len(rs) // 2] for name, rs in runs.items()}


def report(title: str, figures: dict[str, Run], rps: bool = False) -> None:
    print(f"\n{title}")
    direct = figures["direct"]
    for name, run in figures.items():
        line = f"  {name:>8}: p50 {run.p50:8.3f} ms  p99 {run.p99:8.3f} ms  {run.rps:9.0f} req/s"
        if name != "direct":
            line += f"   adds p50 {run.p50 - direct.p50:.3f} ms, p99 {run.p99 - direct.p99:.3f} ms"
            if rps:
                line += f", {run.rps / direct.rps:.3f}x direct's req/s"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of direct and proxies")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="paced upstream: gap between events")
    parser.add_argument("--tokens", type=int, default=20, help="paced upstream: text chunks per stream")
    parser.add_argument("--litellm", action="store_true", help="measure LiteLLM proxy beside ours")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk): nothing measured")
        return
    root = Path(tempfile.mkdtemp(prefix="wrk-bench-"))
    servers: list[ManagedServer] = []
    try:
        paced = ManagedServer(lambda port: [
            sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port),
            "--gap-ms", str(args.gap_ms), "--tokens", str(args.tokens),
        ])  # fmt: skip
        servers.append(paced)
        upstream, gateway, key = fake_and_gateway(root, servers, more={"paced": paced.base_url})
        auth = {"Authorization": f"Bearer {key}"}
        proxies = {"gateway": (gateway.base_url, auth)}
        if args.litellm:
            litellm = start_litellm(root, upstream.base_url)
            servers.append(litellm)
            proxies["litellm"] = (litellm.base_url, {"Authorization": f"Bearer {LITELLM_MASTER}"})
        print(f"wrk against the fake upstream, direct and through each proxy; {os.cpu_count()} CPUs, "
              f"{args.rounds} alternated rounds of {args.seconds:g} s, the median round shown")  # fmt: skip
        for stream in (False, True):
            targets = {"direct": (upstream.base_url + PATH, script(root, "direct", {}, stream))}
            for name, (base, headers) in proxies.items():
                targets[name] = (base + PATH, script(root, name, headers, stream))
            what = "streams (one write)" if stream else "whole answers"
            report(f"{what}, concurrency 1:", rounds(targets, 1, args.seconds, args.rounds))
            if not stream:
                report(f"{what}, concurrency 32:", rounds(targets, 32, args.seconds, args.rounds), rps=True)
        # the paced fake serves the model "paced" through the gateway; direct, any model name
        paced_targets = {"direct": (paced.base_url + PATH, script(root, "direct", {}, True))}
        paced_lua = script(root, "gateway-paced", auth, True)
        paced_lua.write_text(paced_lua.read_text().replace('\\"fast\\"', '\\"paced\\"'))
        paced_targets["gateway"] = (gateway.base_url + PATH, paced_lua)
        report(f"paced streams ({args.tokens} chunks {args.gap_ms:g} ms apart; latency to the last byte), "
               "concurrency 1:", rounds(paced_targets, 1, args.seconds, args.rounds))  # fmt: skip
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    main()
