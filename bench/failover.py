"""Failover under load: the whole engine pool is killed, then restarted, while traffic keeps coming.

Two engine replicas (the fake OpenAI upstream from tests/fakes/, or real engine servers with
--engine-model) and a fake hosted provider sit behind one gateway. Workers send requests back to
back (half of them streamed). After a steady phase both replicas get SIGKILL; later they are
started again on the same ports. Reported: failed requests (whole and streamed), time to detect
(from the kill to the last request that still tried a dead replica), time to return (from the
restart to the first answer from the pool again), and latency p50/p99 before, during the first
5 s after the kill, and after the return.

Usage: python bench/failover.py [--workers 8] [--steady 5] [--down 8] [--engine-model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine.server_proc import ManagedServer, ServerProcess  # noqa: E402
from tests.gateway.processes import create_key_cli, start_gateway  # noqa: E402


@dataclass
class Sample:
    """One request: when it ended, how long it took, what served it, what was tried first."""

    end: float
    seconds: float
    status: int
    streamed: bool
    backend: str
    failover: str
    broken: bool  # a streamed answer that ended with an error event


def replica(port: int | None, engine_model: str | None) -> ManagedServer:
    if engine_model:
        return ServerProcess(engine_model, "--kv-cache-memory", str(64 << 20), "--no-access-log", port=port)
    command = [sys.executable, "tests/fakes/openai_upstream.py", "--port"]
    return ManagedServer(lambda p: [*command, str(p)], 60, port=port)


async def _worker(client: httpx.AsyncClient, url: str, key: str, model: str, index: int,
                  samples: list[Sample], stop: threading.Event) -> None:  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    n = 0
    while not stop.is_set():
        streamed = (index + n) % 2 == 1
        n += 1
        body = {"model": model, "max_tokens": 8, "stream": streamed,
                "messages": [{"role": "user", "content": "steady traffic through the gateway"}]}  # fmt: skip
        start = time.monotonic()
        status, backend, tried, broken = 0, "", "", False
        try:
            async with client.stream("POST", url, json=body, headers=headers) as r:
                status, backend = r.status_code, r.headers.get("x-gateway-backend", "")
                tried = r.headers.get("x-gateway-failover", "")
                async for line in r.aiter_lines():
                    broken = broken or line.startswith('data: {"error"')
        except httpx.HTTPError:
            status = 0
        end = time.monotonic()
        samples.append(Sample(end, end - start, status, streamed, backend, tried, broken))


def run_load(url: str, key: str, model: str, workers: int, samples: list[Sample],
             stop: threading.Event) -> threading.Thread:  # fmt: skip
    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(
                *(_worker(client, url, key, model, i, samples, stop) for i in range(workers))
            )

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steady", type=float, default=5.0, help="seconds before the kill")
    parser.add_argument("--down", type=float, default=8.0, help="seconds the pool stays dead")
    parser.add_argument("--after", type=float, default=8.0, help="seconds after the restart")
    parser.add_argument("--engine-model", default=None, help="real engine replicas of this model")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    replicas = [replica(None, args.engine_model), replica(None, args.engine_model)]
    hosted = replica(None, None)
    served = Path(args.engine_model).name if args.engine_model else "fake-model"
    policy = root / "policy.yaml"
    policy.write_text(f"""
backends:
  pool:
    type: engine
    urls: ["{replicas[0].base_url}", "{replicas[1].base_url}"]
    timeouts: {{connect: 0.5, first_token: 5, total: 30}}
  frontier: {{type: hosted, model: openai/fake-model, api_key_env: FAKE_PROVIDER_KEY,
             base_url: "{hosted.base_url}/v1"}}
models:
  local: {{backend: pool, model: {served}, fallbacks: [hosted]}}
  hosted: {{backend: frontier}}
health: {{interval: 0.5, timeout: 0.5, breaker: {{consecutive_failures: 3, cooldown: 2}}}}
""")  # fmt: skip
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "FAKE_PROVIDER_KEY": "sk-fake",
           "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
    gateway = start_gateway(policy, env)
    samples: list[Sample] = []
    stop = threading.Event()
    try:
        key = create_key_cli(env, "bench")
        thread = run_load(
            f"{gateway.base_url}/v1/chat/completions", key, "local", args.workers, samples, stop
        )
        time.sleep(args.steady)
        killed = time.monotonic()
        for r in replicas:
            r.proc.send_signal(signal.SIGKILL)
            r.proc.wait()
        time.sleep(args.down)
        ports = [r.port for r in replicas]
        spawned = time.monotonic()
        replicas = [replica(port, args.engine_model) for port in ports]
        restarted = time.monotonic()  # both replicas answer /health again
        time.sleep(args.after)
        stop.set()
        thread.join(60)
    finally:
        gateway.stop()
        for r in [*replicas, hosted]:
            if r.proc.poll() is None:
                r.stop()
    print(f"replicas restarted: answering /health {restarted - spawned:.2f} s after they were started")
    report(samples, killed, spawned, [f"127.0.0.1:{p}" for p in ports])


def report(samples: list[Sample], killed: float, restarted: float, pool: list[str]) -> None:
    whole = [s for s in samples if not s.streamed]
    streams = [s for s in samples if s.streamed]
    failed_whole = sum(1 for s in whole if s.status != 200)
    failed_streams = sum(1 for s in streams if s.status != 200 or s.broken)
    tried_dead = [s.end for s in samples if killed < s.end < restarted
                  and any(f"{p}=" in s.failover for p in pool)]  # fmt: skip
    detect = (max(tried_dead) - killed) if tried_dead else 0.0
    back = [s.end for s in samples if s.end > restarted and s.backend == "pool"]
    before = [s.seconds for s in samples if s.end < killed]
    during = [s.seconds for s in samples if killed <= s.end < killed + 5]
    after = [s.seconds for s in samples if back and s.end >= min(back)]
    print(f"\n{len(samples)} requests ({len(whole)} whole, {len(streams)} streamed)")
    print(f"failed: whole {failed_whole}, streamed {failed_streams}")
    print(f"time to detect: {detect:.2f} s (last request that still tried a dead replica)")
    returned = f"{(min(back) - restarted):.2f} s" if back else "never"
    print(f"time to return: {returned} (from the restart to the first answer from the pool)")
    phases = (("before", before), ("first 5 s after the kill", during), ("after the return", after))
    for label, values in phases:
        p50, p99 = pct(values, 0.5), pct(values, 0.99)
        print(f"latency {label:<26} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  (n={len(values)})")


if __name__ == "__main__":
    main()
