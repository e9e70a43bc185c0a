"""Prefix-affinity vs least-loaded balancing over two engine replicas behind the gateway, one run.

Two engine servers (the default model, one CPU thread each) behind one gateway worker, whose pool
balances `least_loaded` in one phase and `prefix_affinity` in the other (the policy file is
rewritten and hot-reloaded between them). Workload: S system prompts of ~T tokens (random words,
a fresh set per phase so no phase finds another's prefixes cached), U users each asking a short
question, sent in a seeded random order with C requests at a time, streamed, M tokens each.
Reported per phase: the engines' prefix-cache hit rate over the phase (hits / queried prompt
tokens, from their /metrics), mean and p50 TTFT (first chunk carrying text), output tokens/s;
for the affinity phase the gateway's calls to a prefix's home and spills, and the prefixes each
replica is home to. A third phase sends a fresh set to one replica directly: the single-replica
hit rate (--no-single skips it).

Each engine gets --kv-cache-mib of KV pool (512: ~11,000 tokens of the default model, about all 8
prompts; less makes the replicas' aggregate cache the question, which is where affinity matters
most: least-loaded asks each replica to hold every prompt, affinity only its share).

Usage: python bench/affinity.py [--systems 8] [--system-tokens 1000] [--users 12]
           [--concurrency 8] [--max-tokens 8] [--kv-cache-mib 512] [--load-factor F]
           [--engine-args "..."] [--no-single]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine.server_proc import ManagedServer, ServerProcess  # noqa: E402
from tests.gateway.processes import create_key_cli, start_gateway  # noqa: E402

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november")  # fmt: skip


def systems(count: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"System {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(tokens)) for i in range(count)]


def workload(prompts: list[str], users: int, seed: int) -> list[list[dict[str, str]]]:
    requests = [[{"role": "system", "content": s}, {"role": "user", "content": f"Question {u}: say hi."}]
                for s in prompts for u in range(users)]  # fmt: skip
    random.Random(seed).shuffle(requests)
    return requests


def prefix_counters(engines: list[ManagedServer]) -> tuple[float, float]:
    """(prompt tokens queried, found) summed over the engines."""
    queried = found = 0.0
    for engine in engines:
        for line in httpx.get(f"{engine.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith("engine:prefix_cache_queries_total"):
                queried += float(line.rsplit(" ", 1)[1])
            elif line.startswith("engine:prefix_cache_hits_total"):
                found += float(line.rsplit(" ", 1)[1])
    return queried, found


async def run(url: str, headers: dict[str, str], model: str, requests: list, concurrency: int,
              max_tokens: int) -> tuple[list[float], int, float]:  # fmt: skip
    """(TTFTs in seconds, output chunks, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    chunks = 0

    async def one(client: httpx.AsyncClient, messages: list) -> None:
        nonlocal chunks
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}  # fmt: skip
        async with gate:
            start = time.perf_counter()
            first: float | None = None
            async with client.stream("POST", url, json=body, headers=headers) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        first = first or time.perf_counter() - start
                        chunks += 1
            if first is not None:
                ttfts.append(first)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, m) for m in requests))
    return ttfts, chunks, time.perf_counter() - started


def affinity_counts(gateway_url: str) -> str:
    """The gateway's calls to a prefix's home replica and spills to another, and the prefixes each
    replica is home to, from its /metrics."""
    text = httpx.get(f"{gateway_url}/metrics", headers={"authorization": "Bearer m"}, timeout=10).text
    counts, placed = [], []
    for line in text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("gateway_affinity_requests_total"):
            outcome = line.partition('outcome="')[2].partition('"')[0]
            counts.append(f"{outcome} {float(value):.0f}")
        elif line.startswith("gateway_affinity_prefixes{"):
            placed.append(f"{float(value):.0f}")
    return f"{', '.join(counts)}; prefixes per replica {'/'.join(placed)}"


def phase(name: str, engines: list[ManagedServer], url: str, headers: dict[str, str], model: str,
          requests: list, args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    q0, f0 = prefix_counters(engines)
    ttfts, chunks, wall = asyncio.run(run(url, headers, model, requests, args.concurrency, args.max_tokens))
    q1, f1 = prefix_counters(engines)
    result = {"hit_rate": (f1 - f0) / max(q1 - q0, 1.0), "ttft_mean": statistics.mean(ttfts),
              "ttft_p50": statistics.median(ttfts), "tok_s": chunks / wall}  # fmt: skip
    print(f"{name:>16}: prefix-cache hit rate {result['hit_rate']:.3f}, TTFT mean "
          f"{result['ttft_mean'] * 1e3:.0f} ms (p50 {result['ttft_p50'] * 1e3:.0f}), "
          f"{result['tok_s']:.1f} output tok/s")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="each engine's KV pool")
    parser.add_argument("--engine-args", default="", help="more `engine serve` options for both replicas")
    parser.add_argument("--load-factor", type=float, default=None, help="the pool's max_load_factor")
    parser.add_argument("--no-single", action="store_true", help="skip the one-replica phase")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="affinity-bench-"))
    options = ("--kv-cache-memory", str(args.kv_cache_mib << 20), "--num-threads", "1", "--no-access-log",
               *shlex.split(args.engine_args))  # fmt: skip
    engines = [ServerProcess("default", *options) for _ in range(2)]
    gateway = None
    try:
        urls = ", ".join(f'"{e.base_url}"' for e in engines)
        policy = root / "policy.yaml"

        def write_policy(balance: str) -> None:
            factor = "" if args.load_factor is None else f", max_load_factor: {args.load_factor}"
            pool = f"{{type: engine, urls: [{urls}], balance: {balance}{factor}}}"
            models = "models:\n  chat: {backend: pool, model: default}\n"
            policy.write_text(f"backends:\n  pool: {pool}\n{models}")

        write_policy("least_loaded")
        env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'g.db'}"}  # fmt: skip
        gateway = start_gateway(policy, env)
        headers = {"authorization": f"Bearer {create_key_cli(env, 'bench')}"}
        url = f"{gateway.base_url}/v1/chat/completions"
        print(f"{args.systems} system prompts x ~{args.system_tokens} words, {args.users} users each, "
              f"{args.concurrency} at a time, {args.max_tokens} tokens; 2 replicas, "
              f"{args.kv_cache_mib} MiB of KV each")  # fmt: skip
        sets = [workload(systems(args.systems, args.system_tokens, i), args.users, i) for i in (1, 2, 3)]
        least = phase("least_loaded", engines, url, headers, "chat", sets[0], args)
        write_policy("prefix_affinity")
        time.sleep(3)  # the gateway's policy watcher picks the change up
        affinity = phase("prefix_affinity", engines, url, headers, "chat", sets[1], args)
        print(f"{'':>16}  gateway: {affinity_counts(gateway.base_url)}")
        if args.no_single:
            print(f"mean TTFT least_loaded / prefix_affinity: "
                  f"{least['ttft_mean'] / affinity['ttft_mean']:.2f}x; "
                  f"throughput ratio {affinity['tok_s'] / least['tok_s']:.2f}")  # fmt: skip
            return
        direct = f"{engines[0].base_url}/v1/chat/completions"
        single = phase("one replica", engines[:1], direct, {}, "default", sets[2], args)
        print(f"affinity hit rate / one replica's: {affinity['hit_rate'] / single['hit_rate']:.2f}; "
              f"mean TTFT least_loaded / prefix_affinity: {least['ttft_mean'] / affinity['ttft_mean']:.2f}x; "
              f"throughput ratio {affinity['tok_s'] / least['tok_s']:.2f}")  # fmt: skip
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    main()
