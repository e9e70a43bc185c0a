"""Streams as an outside harness sees them, in one run: direct to a paced fake upstream vs our gateway.

The fake (tests/fakes/fast_upstream.py --gap-ms) streams like a model: chunked, one SSE event per
write, GAP ms apart, a role-only first chunk and then TOKENS chunks of one word each. Measured:
- at concurrency 1, with httpx as the official client reads a stream: the time to the first chunk
  that carries text (not the role-only chunk) and to the end; "added" = through the proxy minus
  direct. A second fake (`--hold-head`) sends its head and role chunk only with its first word, as
  our gateway does with the policy's `stream_head: first_token` (by default the head goes with the
  upstream's first event): "held" minus direct is what holding the head alone costs the client (it
  parses the head after the first text, not during the gap);
- at concurrency C for S seconds: the proxy process's CPU time (user + system, from /proc) per
  relayed chunk, and that CPU less what the same number of whole (non-streamed) requests costs;
  for ours also the slope between streams of TOKENS and TOKENS/4 words through the same process,
  the relay's own cost per further chunk (what a stream costs once cancels out).
LiteLLM proxy can run beside ours (`--litellm`: bench/gateway_overhead.py installs it), and a bare
byte relay (`--bare`: bench/bare_relay.py, no HTTP, no parsing) whose CPU per chunk is the floor
of any relay in Python on uvloop on the machine. With
`--sdk`, the concurrency-1 streams are read with the official OpenAI SDK (each event parsed into
its objects, as an application does) instead of httpx lines.

Usage: python bench/stream_relay.py [--gap-ms 5] [--tokens 20] [--requests 200] [--litellm] [--bare] [--sdk]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import LITELLM_MASTER, fake_and_gateway, start_litellm  # noqa: E402
from tests.engine.server_proc import ManagedServer  # noqa: E402

PATH = "/v1/chat/completions"
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    """One way to reach the upstream, and the process whose CPU it costs (None: direct)."""

    name: str
    url: str
    headers: dict[str, str]
    server: ManagedServer | None
    model: str = "fast"


@dataclass
class Timing:
    """One streamed request at concurrency 1 (seconds from sending it)."""

    first_byte: float
    first_text: float
    total: float
    chunks: int


def body(stream: bool, model: str = "fast") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "one two three"}], "stream": stream}


def stream_once(client: httpx.Client, target: Target) -> Timing:
    """One streamed request read line by line; which chunk first carried text, and when."""
    start = time.perf_counter()
    first_byte = first_text = 0.0
    chunks = 0
    with client.stream("POST", target.url, json=body(True, target.model), headers=target.headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{target.name}: status {response.status_code}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - start
            first_byte = first_byte or now
            if line == "data: [DONE]":
                break
            chunks += 1
            event = json.loads(line[6:])
            choices = event.get("choices") or [{}]
            if not first_text and (choices[0].get("delta") or {}).get("content"):
                first_text = now
    return Timing(first_byte, first_text, time.perf_counter() - start, chunks)


def sdk_stream_once(client: openai.OpenAI, target: Target) -> Timing:
    """One streamed request read with the official SDK: which chunk first carried text, and when."""
    start = time.perf_counter()
    first_byte = first_text = 0.0
    chunks = 0
    stream = client.chat.completions.create(
        model="fast", messages=[{"role": "user", "content": "one two three"}], stream=True,
        extra_headers=target.headers,
    )  # fmt: skip
    for chunk in stream:
        now = time.perf_counter() - start
        first_byte = first_byte or now
        chunks += 1
        if not first_text and chunk.choices and chunk.choices[0].delta.content:
            first_text = now
    return Timing(first_byte, first_text, time.perf_counter() - start, chunks)


def cpu_seconds(server: ManagedServer) -> float:
    """User + system CPU of the server process so far."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def load(target: Target, stream: bool, concurrency: int, seconds: float) -> tuple[int, int]:
    """`concurrency` clients for `seconds`: (requests, chunks received)."""
    totals = [0, 0]
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client_loop() -> None:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < end:
                if stream:
                    chunks = stream_once(client, target).chunks
                else:
                    r = client.post(target.url, json=body(False, target.model), headers=target.headers)
                    r.raise_for_status()
                    chunks = 0
                with lock:
                    totals[0] += 1
                    totals[1] += chunks

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return totals[0], totals[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def measure(
    targets: list[Target],
    requests: int,
    concurrency: int,
    seconds: float,
    sdk: bool = False,
    short: Target | None = None,
) -> None:
    timings: dict[str, list[Timing]] = {t.name: [] for t in targets}
    clients = {t.name: httpx.Client(timeout=30) for t in targets}
    sdks = {
        t.name: openai.OpenAI(base_url=t.url.removesuffix("/chat/completions"), api_key="unused")
        for t in targets
    }

    def once(t: Target) -> Timing:
        return sdk_stream_once(sdks[t.name], t) if sdk else stream_once(clients[t.name], t)

    try:
        for _ in range(20):  # warm-up
            for t in targets:
                once(t)
        order = random.Random(0)
        for _ in range(requests):  # interleaved: drift on a noisy machine hits every target alike,
            for t in order.sample(targets, len(targets)):  # in a new order each time: in a fixed
                timings[t.name].append(once(t))  # one, what ran before a target slowed it (gateway_ab.py)
    finally:
        for client in clients.values():
            client.close()
    direct = timings["direct"]
    reader = "the OpenAI SDK" if sdk else "httpx"
    print(f"\nconcurrency 1, {requests} streams each, read with {reader}, ms (p50 / p99):")
    print(f"{'':>9} {'1st byte':>17} {'1st text':>17} {'whole':>17}")
    for name, ts in timings.items():
        cols = [(pct([getattr(x, f) for x in ts], 0.5), pct([getattr(x, f) for x in ts], 0.99))
                for f in ("first_byte", "first_text", "total")]  # fmt: skip
        print(f"{name:>9} " + " ".join(f"{a:8.3f} /{b:7.3f}" for a, b in cols))
    for name, ts in timings.items():
        if name == "direct":
            continue
        added = pct([x.first_text for x in ts], 0.5) - pct([x.first_text for x in direct], 0.5)
        whole = pct([x.total for x in ts], 0.5) - pct([x.total for x in direct], 0.5)
        what = "the held head adds" if name == "held" else f"{name} adds"
        print(f"  {what}: first text chunk {added:.3f} ms (p50), whole stream {whole:.3f} ms")
    print(f"\nCPU of each proxy process, {concurrency} clients for {seconds:g} s each:")
    for t in targets:
        if t.server is None:
            continue
        before = cpu_seconds(t.server)
        whole_requests, _ = load(t, False, concurrency, seconds)
        per_request = (cpu_seconds(t.server) - before) / whole_requests
        before = cpu_seconds(t.server)
        streams, chunks = load(t, True, concurrency, seconds)
        cpu = cpu_seconds(t.server) - before
        relay = (cpu - streams * per_request) / chunks
        print(f"  {t.name:>8}: {per_request * 1e3:.3f} ms per whole request; streams: "
              f"{cpu / chunks * 1e3:.3f} ms per chunk in all, {relay * 1e3:.3f} ms per chunk "
              f"for the relay ({streams} streams, {chunks} chunks)")  # fmt: skip
        if short is not None and short.server is t.server:
            marginal(t, short, cpu / streams, chunks / streams, concurrency, seconds)


def marginal(long: Target, short: Target, cpu_long: float, chunks_long: float, concurrency: int,
             seconds: float) -> None:  # fmt: skip
    """The relay's own CPU per chunk as the slope between streams of two lengths through the same
    proxy: what a stream costs once (its request, its head, its end) cancels out, where "less the
    whole requests" leaves in what a stream costs beyond a whole answer."""
    assert short.server is not None
    before = cpu_seconds(short.server)
    streams, chunks = load(short, True, concurrency, seconds)
    cpu_short = (cpu_seconds(short.server) - before) / streams
    slope = (cpu_long - cpu_short) / (chunks_long - chunks / streams)
    print(f"  {long.name:>8}: streams of {chunks / streams:.0f} chunks {cpu_short * 1e3:.3f} ms, of "
          f"{chunks_long:.0f} chunks {cpu_long * 1e3:.3f} ms: {slope * 1e3:.3f} ms per further chunk, "
          f"{(cpu_short - slope * chunks / streams) * 1e3:.3f} ms per stream besides")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gap-ms", type=float, default=5.0, help="upstream gap between events")
    parser.add_argument("--tokens", type=int, default=20, help="text chunks per stream")
    parser.add_argument("--requests", type=int, default=200, help="streams per target at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=4, help="clients for the CPU measurement")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each CPU measurement")
    parser.add_argument("--litellm", action="store_true", help="measure LiteLLM proxy beside ours")
    parser.add_argument("--bare", action="store_true", help="measure a bare byte relay beside ours")
    parser.add_argument(
        "--sdk", action="store_true", help="read the c=1 streams with the official OpenAI SDK"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    servers: list[ManagedServer] = []
    try:
        pacing = ("--gap-ms", str(args.gap_ms), "--tokens", str(args.tokens))
        few = ("--gap-ms", str(args.gap_ms), "--tokens", str(max(1, args.tokens // 4)))
        fewer = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port), *few]
        )  # a second length of stream: the relay's slope per chunk
        servers.append(fewer)
        upstream, gateway, key = fake_and_gateway(root, servers, *pacing, more={"short": fewer.base_url})
        held = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port), *pacing,
                          "--hold-head"]
        )  # fmt: skip
        servers.append(held)
        targets = [
            Target("direct", upstream.base_url + PATH, {}, None),
            Target("held", held.base_url + PATH, {}, None),
            Target("gateway", gateway.base_url + PATH, {"authorization": f"Bearer {key}"}, gateway),
        ]
        if args.litellm:
            litellm = start_litellm(root, upstream.base_url)
            servers.append(litellm)
            auth = {"authorization": f"Bearer {LITELLM_MASTER}"}
            targets.append(Target("litellm", litellm.base_url + PATH, auth, litellm))
        if args.bare:
            bare = ManagedServer(
                lambda port: [sys.executable, "bench/bare_relay.py", "--port", str(port),
                              "--upstream-port", str(upstream.port)]
            )  # fmt: skip
            servers.append(bare)
            targets.append(Target("bare", bare.base_url + PATH, {}, bare))
        print(f"upstream: {args.tokens} text chunks {args.gap_ms:g} ms apart; {os.cpu_count()} CPUs")
        auth = {"authorization": f"Bearer {key}"}
        short = Target("gateway", gateway.base_url + PATH, auth, gateway, "short")
        measure(targets, args.requests, args.concurrency, args.seconds, args.sdk, short)
    finally:
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    main()
