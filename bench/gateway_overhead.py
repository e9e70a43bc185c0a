"""Gateway overhead: direct to a fast fake upstream vs through our gateway, in one run.

Measures, non-streamed and streamed: added latency at concurrency 1 (p50/p99 of gateway minus
direct), requests/s at concurrency 32, and the time to the first streamed chunk. One gateway
worker with auth, routing and request logging on (SQLite). The comparison with LiteLLM proxy
(installed in its own virtualenv) is not part of this script yet.

Usage: python bench/gateway_overhead.py [--requests 400] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine.server_proc import ManagedServer  # noqa: E402
from tests.gateway.processes import create_key_cli, start_gateway  # noqa: E402

BODY = {"model": "fast", "messages": [{"role": "user", "content": "one two three four five"}]}


async def latencies(
    url: str, headers: dict[str, str], n: int, stream: bool
) -> tuple[list[float], list[float]]:
    """Sequential requests: (total latency, time to first chunk) per request, in ms."""
    totals, firsts = [], []
    body = {**BODY, "stream": stream}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            start = time.perf_counter()
            if stream:
                async with client.stream("POST", url, json=body, headers=headers) as resp:
                    first = None
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data: "):
                            first = time.perf_counter()
                    firsts.append(((first or time.perf_counter()) - start) * 1e3)
            else:
                (await client.post(url, json=body, headers=headers)).raise_for_status()
            totals.append((time.perf_counter() - start) * 1e3)
    return totals, firsts


async def throughput(url: str, headers: dict[str, str], n: int, concurrency: int) -> float:
    """Requests per second with `concurrency` requests in flight."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                (await client.post(url, json=BODY, headers=headers)).raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    upstream = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)]
    )
    policy = root / "policy.yaml"
    policy.write_text(f'backends:\n  fake: {{type: engine, urls: ["{upstream.base_url}"]}}\n'
                      "models:\n  fast: {backend: fake}\n")  # fmt: skip
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
    gateway = start_gateway(policy, env)
    key = create_key_cli(env, "bench")
    targets = {
        "direct": (f"{upstream.base_url}/v1/chat/completions", {}),
        "gateway": (f"{gateway.base_url}/v1/chat/completions", {"Authorization": f"Bearer {key}"}),
    }
    try:
        results: dict[str, dict[str, float]] = {}
        for name, (url, headers) in targets.items():
            asyncio.run(latencies(url, headers, 50, stream=False))  # warm-up
            whole, _ = asyncio.run(latencies(url, headers, args.requests, stream=False))
            _, first = asyncio.run(latencies(url, headers, args.requests, stream=True))
            rps = asyncio.run(throughput(url, headers, args.requests * 2, args.concurrency))
            results[name] = {
                "p50": statistics.median(whole), "p99": pct(whole, 0.99),
                "first_p50": statistics.median(first), "rps": rps,
            }  # fmt: skip
            r = results[name]
            print(f"{name:>8}: p50 {r['p50']:.3f} ms  p99 {r['p99']:.3f} ms  first chunk p50 "
                  f"{r['first_p50']:.3f} ms  {rps:.0f} req/s at c={args.concurrency}")  # fmt: skip
        d, g = results["direct"], results["gateway"]
        print(f"\nadded latency c=1: p50 {g['p50'] - d['p50']:.3f} ms, p99 {g['p99'] - d['p99']:.3f} ms")
        print(f"added time to first streamed chunk c=1: p50 {g['first_p50'] - d['first_p50']:.3f} ms")
        print(f"requests/s at c={args.concurrency}: gateway {g['rps']:.0f} vs direct {d['rps']:.0f} "
              f"({g['rps'] / d['rps']:.2f}x)")  # fmt: skip
    finally:
        gateway.stop()
        upstream.stop()


if __name__ == "__main__":
    main()
