"""Load-test sweep: find the peak request rate that meets a latency SLO, then load at 1x, 2x, 3x of it.

Works against any OpenAI-compatible URL (our engine, the gateway in front of it, vLLM, a hosted
API): streamed `/v1/chat/completions` (or `/v1/completions`) with text prompts of seeded random
words, `stream_options.include_usage` for the token counts (text chunks are counted when a server
sends no usage). Requests arrive as a seeded Poisson process at the rate under test.

A request meets the SLO when it completes with TTFT (time to the first chunk that carries text)
<= --slo-ttft-ms and TPOT ((latency - TTFT) / (output tokens - 1)) <= --slo-tpot-ms. A rate meets
the SLO when at least --slo-attainment of the requests sent at it do (failures and timeouts count
against it). A level at rate R for D seconds sends R x D requests (at least --min-requests) with
seeded exponential gaps, then waits for every answer (or its --request-timeout).

The peak search doubles the rate from --start-rate until a level misses (halves it down to
--min-rate when the first one misses), then bisects --search-steps times; search levels last
--search-duration seconds. Then each multiple of the peak (--multipliers, 1,2,3) runs
--level-duration seconds. While a level runs, the queue is sampled every --sample-interval
seconds: requests in flight (client side) and, when the server exports one, its queue gauge
(engine:num_requests_waiting, vllm:num_requests_waiting, sglang:num_queue_reqs, tgi_queue_size or
gateway_pool_queue_depth at --metrics-url, by default the base URL's /metrics).

Writes OUT/sweep.json (every figure, every request) and OUT/sweep.html (self-contained: charts of
latency percentiles, goodput and errors against offered load, queue depth over time).

Usage:
  python bench/sweep.py --base-url http://127.0.0.1:8000 [--api-key K] [--model M] [--out DIR]
  python bench/sweep.py --serve default [--engine-args "..."]   # start our engine and sweep it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sweep_report import summarize, write_report  # noqa: E402

QUEUE_GAUGES = (
    "engine:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size",
    "gateway_pool_queue_depth",
)  # fmt: skip
_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place",
    "case", "week", "company", "system", "program", "question", "work", "government", "number",
    "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month",
    "lot", "right", "study", "book", "eye", "job", "word", "business", "issue",
)  # fmt: skip


@dataclass(frozen=True)
class Target:
    """Where the load goes and how requests look."""

    base_url: str
    model: str | None
    api_key: str | None
    endpoint: str  # "chat" or "completions"
    input_words: int
    output_tokens: int
    ignore_eos: bool
    request_timeout: float

    def body(self, prompt: str) -> dict[str, Any]:
        """One streamed request's JSON body."""
        body: dict[str, Any] = {
            "max_tokens": self.output_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass(frozen=True)
class Slo:
    """The per-request latency objective and the share of requests that must meet it."""

    ttft_ms: float
    tpot_ms: float
    attainment: float


@dataclass
class Outcome:
    """One request: when it was sent (seconds into its level) and how it went."""

    sent_at: float
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""  # "" or a class: http_<status>, timeout, connect, bad_stream, stream_error, empty

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def meets(self, slo: Slo) -> bool:
        return self.ok and self.ttft * 1e3 <= slo.ttft_ms and self.tpot * 1e3 <= slo.tpot_ms


@dataclass
class Level:
    """Everything one load level measured."""

    rate: float
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    queue: list[tuple[float, int, float | None]] = field(default_factory=list)  # (t, in flight, server)
    elapsed: float = 0.0  # from the first send to the last answer

    def attainment(self, slo: Slo) -> float:
        return sum(o.meets(slo) for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


def prompts(seed: int, words: int, count: int) -> list[str]:
    """`count` seeded prompts of `words` random common words, each asking for a story."""
    rng = random.Random(seed)
    return [
        "Write a story using these words: " + " ".join(rng.choice(_WORDS) for _ in range(words))
        for _ in range(count)
    ]


def _text_of(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        parts.append(str(delta.get("content") or choice.get("text") or ""))
    return "".join(parts)


async def _stream(client: httpx.AsyncClient, target: Target, prompt: str, out: Outcome, start: float) -> None:
    chunks = 0
    usage: int | None = None
    async with client.stream("POST", target.path, json=target.body(prompt)) as resp:
        if resp.status_code != 200:
            await resp.aread()
            out.error = f"http_{resp.status_code}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                out.error = "bad_stream"
                return
            if not isinstance(chunk, dict) or "error" in chunk:
                out.error = "stream_error"
                return
            if isinstance(chunk.get("usage"), dict):
                usage = int(chunk["usage"].get("completion_tokens") or 0)
            if _text_of(chunk):
                chunks += 1
                if out.ttft == 0.0:
                    out.ttft = time.perf_counter() - start
    out.latency = time.perf_counter() - start
    out.output_tokens = usage if usage else chunks
    out.ok = out.output_tokens > 0 and out.ttft > 0.0
    if not out.ok:
        out.error = "empty"


async def one_request(client: httpx.AsyncClient, target: Target, prompt: str, sent_at: float) -> Outcome:
    """Send one streamed request; never raises: failures are classified in the outcome."""
    out = Outcome(sent_at=sent_at)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(target.request_timeout):
            await _stream(client, target, prompt, out, start)
    except TimeoutError:
        out.ok, out.error = False, "timeout"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        out.ok, out.error = False, "connect"
    except httpx.HTTPError:
        out.ok, out.error = False, "http_client"
    return out


async def server_queue(client: httpx.AsyncClient, url: str) -> float | None:
    """The first known queue gauge at `url` (summed over its label sets), None when there is none."""
    try:
        resp = await client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    except ValueError:
        return None
    for name in QUEUE_GAUGES:
        family = families.get(name)
        if family is not None:  # a labelled gauge has no sample before its first request: 0
            return float(sum(s.value for s in family.samples))
    return None


async def run_level(
    client: httpx.AsyncClient, target: Target, rate: float, duration: float, args: argparse.Namespace
) -> Level:
    """Send rate x duration requests (at least --min-requests) with Poisson gaps; wait for every answer."""
    level = Level(rate=rate, duration=duration)
    rng = random.Random(f"{args.seed}:{rate:.6f}")
    texts = prompts(args.seed, target.input_words, 64)
    loop = asyncio.get_running_loop()
    start = loop.time()
    in_flight: set[asyncio.Task[Outcome]] = set()
    sending = True

    async def sample() -> None:
        while True:
            depth = await server_queue(client, args.metrics_url) if args.metrics_url else None
            level.queue.append((round(loop.time() - start, 3), len(in_flight), depth))
            if not (sending or in_flight):
                return
            await asyncio.sleep(args.sample_interval)

    sampler = asyncio.create_task(sample())
    tasks: list[asyncio.Task[Outcome]] = []
    t = 0.0
    for i in range(max(args.min_requests, round(rate * duration))):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, start + t - loop.time()))
        task = asyncio.create_task(one_request(client, target, texts[i % len(texts)], round(t, 3)))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        tasks.append(task)
    sending = False
    level.outcomes = list(await asyncio.gather(*tasks))
    level.elapsed = loop.time() - start
    await sampler
    return level


def _describe(level: Level, slo: Slo) -> str:
    ok = sum(o.ok for o in level.outcomes)
    return (
        f"rate {level.rate:8.3f} req/s: {len(level.outcomes):4d} sent, {ok:4d} ok, "
        f"SLO met by {level.attainment(slo):6.1%}"
    )


async def find_peak(
    client: httpx.AsyncClient, target: Target, slo: Slo, args: argparse.Namespace, trials: list[Level]
) -> float | None:
    """The highest rate tried that met the SLO (None when none did); every level tried goes to `trials`."""

    async def meets(rate: float) -> bool:
        level = await run_level(client, target, rate, args.search_duration, args)
        trials.append(level)
        print("  search " + _describe(level, slo), flush=True)
        return level.attainment(slo) >= slo.attainment

    passing: float | None = None
    failing: float | None = None
    rate = args.start_rate
    while rate <= args.max_rate:
        if not await meets(rate):
            failing = rate
            break
        passing, rate = rate, rate * 2
    if passing is None:
        rate = args.start_rate / 2
        while rate >= args.min_rate:
            if await meets(rate):
                passing = rate
                break
            failing, rate = rate, rate / 2
    if passing is None or failing is None:
        return passing
    for _ in range(args.search_steps):
        mid = (passing + failing) / 2
        if await meets(mid):
            passing = mid
        else:
            failing = mid
    return passing


async def sweep(target: Target, slo: Slo, args: argparse.Namespace) -> dict[str, Any]:
    """Search the peak, run every multiple of it, and return the report's data."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=args.max_connections, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.request_timeout, connect=10.0)
    async with httpx.AsyncClient(
        base_url=target.base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        if args.metrics_url and await server_queue(client, args.metrics_url) is None:
            print(f"no queue gauge at {args.metrics_url}: queue depth is the client's in-flight count only")
            args.metrics_url = None
        texts = prompts(args.seed, target.input_words, max(1, args.warmup))
        warm = await asyncio.gather(
            *(one_request(client, target, text, 0.0) for text in texts[: args.warmup])
        )
        print(f"warm-up: {sum(o.ok for o in warm)}/{len(warm)} ok", flush=True)
        trials: list[Level] = []
        peak = await find_peak(client, target, slo, args, trials)
        levels: list[tuple[float, Level]] = []
        if peak is not None:
            print(f"peak: {peak:.3f} req/s", flush=True)
            for m in args.multipliers:
                level = await run_level(client, target, m * peak, args.level_duration, args)
                levels.append((m, level))
                print(f"  {m:g}x " + _describe(level, slo), flush=True)
        else:
            print(f"no rate down to {args.min_rate:.4f} req/s met the SLO", flush=True)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": {k: v for k, v in asdict(target).items() if k != "api_key"},
        "slo": asdict(slo),
        "peak_rate": peak,
        "search": [summarize(level, slo) for level in trials],
        "levels": [
            {
                **summarize(level, slo),
                "multiplier": m,
                "queue": level.queue,
                "requests": [asdict(o) for o in level.outcomes],
            }
            for m, level in levels
        ],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--serve", metavar="MODEL", help="start `python -m engine serve --model MODEL` and sweep it"
    )
    p.add_argument("--engine-args", default="", help="extra `python -m engine serve` options (with --serve)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the request's model field")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--input-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's, ours)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--slo-attainment", type=float, default=0.9)
    p.add_argument("--start-rate", type=float, default=0.5, help="req/s of the first search level")
    p.add_argument("--max-rate", type=float, default=1000.0)
    p.add_argument("--min-rate", type=float, default=None, help="lowest rate tried (default start/64)")
    p.add_argument("--search-steps", type=int, default=3)
    p.add_argument("--search-duration", type=float, default=30.0)
    p.add_argument("--level-duration", type=float, default=60.0)
    p.add_argument("--min-requests", type=int, default=10, help="every level sends at least this many")
    p.add_argument("--multipliers", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 3.0])
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sample-interval", type=float, default=0.5)
    p.add_argument(
        "--metrics-url", default=None, help="Prometheus text with a queue gauge (default BASE/metrics)"
    )
    p.add_argument("--no-metrics", action="store_true")
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("sweep-report"))
    args = p.parse_args(argv)
    if not (args.base_url or args.serve) or (args.base_url and args.serve):
        p.error("give exactly one of --base-url and --serve")
    if args.min_rate is None:
        args.min_rate = args.start_rate / 64
    positive = ("start_rate", "min_rate", "max_rate", "search_duration", "level_duration", "request_timeout")
    for name in (*positive, "sample_interval"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.slo_attainment <= 1 or not args.multipliers or min(args.multipliers) <= 0:
        p.error("--slo-attainment must be in (0, 1] and --multipliers positive")
    return args


def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """Sweep `base_url` and write the report; returns its data."""
    target = Target(
        base_url=base_url.rstrip("/"), model=args.model, api_key=args.api_key, endpoint=args.endpoint,
        input_words=args.input_words, output_tokens=args.output_tokens, ignore_eos=args.ignore_eos,
        request_timeout=args.request_timeout,
    )  # fmt: skip
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_attainment)
    if not args.no_metrics and args.metrics_url is None:
        args.metrics_url = f"{target.base_url}/metrics"
    data = asyncio.run(sweep(target, slo, args))
    json_path, html_path = write_report(data, args.out)
    print(f"wrote {json_path} and {html_path}")
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        data = run(args, args.base_url)
    else:
        from tests.engine.server_proc import ManagedServer

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "engine", "serve", "--model", args.serve, "--port", str(port),
                    "--no-access-log", *args.engine_args.split()]  # fmt: skip

        # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the engine started here is stopped too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        with ManagedServer(command, ready_timeout=300) as server:
            data = run(args, server.base_url)
    return 0 if data["peak_rate"] is not None else 2


if __name__ == "__main__":
    sys.exit(main())
