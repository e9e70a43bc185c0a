"""Online serving benchmark, like `vllm bench serve`: our engine server vs a naive HF server.

A seeded workload (random token-id prompts, fixed or ranged lengths, `ignore_eos`) is sent to
/v1/completions with streaming, either at a Poisson request rate or as fast as a maximum
concurrency allows. Reported per server: completed/failed, request throughput, output tokens/s,
and p50/p99 of TTFT, TPOT (time per output token after the first) and ITL (gap between chunks).
Both servers run one after the other in this process's run, on the same workload, then the
ratios are printed.

Usage:
  python bench/serve.py [--num-prompts 32] [--max-concurrency 16] [--request-rate inf]
                        [--input-len 128] [--output-len 64] [--skip-baseline] [--base-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engine.server_proc import ManagedServer  # noqa: E402


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def make_workload(args: argparse.Namespace) -> list[Request]:
    """Seeded random token-id prompts (ids in the ordinary-text range of the vocabulary)."""
    rng = random.Random(args.seed)

    def length(base: int) -> int:
        spread = int(base * args.range_ratio)
        return rng.randint(base - spread, base + spread)

    return [
        Request([rng.randrange(100, 49000) for _ in range(length(args.input_len))], length(args.output_len))
        for _ in range(args.num_prompts)
    ]


async def one_request(client: httpx.AsyncClient, url: str, model: str | None, req: Request) -> Result:
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    start = time.perf_counter()
    res = Result(ok=False)
    last = start
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    return res


async def run_load(
    url: str, model: str | None, reqs: list[Request], args: argparse.Namespace
) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency if args.max_concurrency > 0 else len(reqs))
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def guarded(req: Request) -> Result:
            async with limit:
                return await one_request(client, url, model, req)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(guarded(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(name: str, results: list[Result], elapsed: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    s = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": elapsed,
        "req_per_s": len(ok) / elapsed,
        "output_tok_per_s": tokens / elapsed,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
        "tpot_p50_ms": pct(tpots, 0.5) * 1e3,
        "tpot_p99_ms": pct(tpots, 0.99) * 1e3,
        "itl_p50_ms": pct(itls, 0.5) * 1e3,
        "itl_p99_ms": pct(itls, 0.99) * 1e3,
        "mean_ttft_ms": statistics.fmean(ttfts) * 1e3 if ttfts else float("nan"),
    }
    print(f"\n=== {name} ===")
    for key, value in s.items():
        print(f"  {key:>18}: {value:,.2f}" if isinstance(value, float) else f"  {key:>18}: {value}")
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"  first error: {errors[0]}")
    return s


def bench_server(
    name: str,
    command: Callable[[int], list[str]] | None,
    url: str | None,
    reqs: list[Request],
    args: argparse.Namespace,
) -> dict[str, float]:
    """Start the server (`command(port)`) unless `url` points at a running one, then load it."""

    async def go(base_url: str) -> tuple[list[Result], float]:
        warm_up = argparse.Namespace(**{**vars(args), "request_rate": float("inf")})
        await run_load(base_url, None, reqs[: min(2, len(reqs))], warm_up)
        return await run_load(base_url, None, reqs, args)

    if command is None:
        assert url is not None
        results, elapsed = asyncio.run(go(url))
    else:
        with ManagedServer(command, ready_timeout=300) as server:
            results, elapsed = asyncio.run(go(server.base_url))
    return summarize(name, results, elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="'default' or a local HF folder")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16, help="0: unlimited")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s); inf: all at once"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn in base*(1±ratio)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--base-url", default=None, help="benchmark a running server instead of starting ours"
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--engine-args", default="", help="extra `python -m engine serve` options")
    args = parser.parse_args()

    from engine.default_model import resolve_model

    model_dir = resolve_model(args.model)
    reqs = make_workload(args)
    print(
        f"workload: {len(reqs)} prompts, input {args.input_len}, output {args.output_len} "
        f"(±{args.range_ratio:.0%}), concurrency {args.max_concurrency or 'unlimited'}, "
        f"rate {args.request_rate}"
    )
    if args.base_url:
        ours = bench_server("ours (running server)", None, args.base_url, reqs, args)
    else:
        engine_args = args.engine_args.split()

        def ours_command(port: int) -> list[str]:
            return [sys.executable, "-m", "engine", "serve", "--model", args.model, "--port", str(port),
                    "--no-access-log", *engine_args]  # fmt: skip

        ours = bench_server("switchboard engine", ours_command, None, reqs, args)
    if args.skip_baseline:
        return

    def baseline_command(port: int) -> list[str]:
        return [sys.executable, str(ROOT / "bench" / "naive_hf_server.py"), "--model", str(model_dir),
                "--port", str(port)]  # fmt: skip

    base = bench_server("naive HF generate server (one at a time)", baseline_command, None, reqs, args)
    print("\n=== ours / baseline ===")
    print(f"  output tokens/s: {ours['output_tok_per_s'] / base['output_tok_per_s']:.2f}x higher")
    print(f"  request throughput: {ours['req_per_s'] / base['req_per_s']:.2f}x higher")
    print(f"  p50 TTFT: {base['ttft_p50_ms'] / ours['ttft_p50_ms']:.2f}x lower")
    print(f"  p99 TTFT: {base['ttft_p99_ms'] / ours['ttft_p99_ms']:.2f}x lower")
    print(f"  p50 TPOT: ours {ours['tpot_p50_ms']:.1f} ms vs {base['tpot_p50_ms']:.1f} ms")


if __name__ == "__main__":
    main()
