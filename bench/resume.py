"""Chaos with streaming clients: replicas killed mid-answer, streams resumed on the other replica.

Two engine replicas (real engine servers; the default model unless --engine-model) sit behind one
gateway. Streaming clients ask, back to back, for greedy answers of `--max-tokens` tokens to a few
prompts. During the run replica a is SIGKILLed, restarted on its port, then replica b is killed
and restarted. The same chaos runs twice, side by side: with `resume_streams: off` (the baseline:
what the gateway did before, an error event) and `on`.

Reported for each: streams, failed streams (not 200, an error event, no [DONE], or a text that is
not the uncut greedy answer), resumed streams (the log's `resumptions`), and the added latency of a
resumption as the client sees it: the longest silence between two chunks of a resumed stream,
minus the median gap between chunks of streams that were not cut (p50 / p99).

Usage: python bench/resume.py [--workers 4] [--max-tokens 48] [--engine-model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.default_model import prepare_default_model  # noqa: E402
from tests.engine.server_proc import ServerProcess  # noqa: E402
from tests.gateway.processes import create_key_cli, read_log_rows, start_gateway  # noqa: E402

PROMPTS = [
    "Explain how a bicycle gear works.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system and one fact about each.",
    "Describe how bread is made, step by step.",
]


@dataclass
class Stream:
    request_id: str
    prompt: int
    status: int
    text: str = ""
    done: bool = False
    broken: bool = False
    gaps: list[float] = field(default_factory=list)


def engine(model: str, port: int | None = None) -> ServerProcess:
    return ServerProcess(model, "--kv-cache-memory", str(256 << 20), "--no-access-log", port=port)


async def _one(client: httpx.AsyncClient, url: str, key: str, prompt: int, max_tokens: int) -> Stream:
    body = {"model": "local", "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPTS[prompt]}]}  # fmt: skip
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        s = Stream(r.headers.get("x-request-id", ""), prompt, r.status_code)
        last = None
        async for line in r.aiter_lines():
            if not line:
                continue
            now = time.monotonic()
            if line == "data: [DONE]":
                s.done = True
            elif line.startswith("data: "):
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    s.broken = True
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if last is not None:
                            s.gaps.append(now - last)
                        last = now
                        s.text += piece
        return s


def run_clients(url: str, key: str, workers: int, max_tokens: int, out: list[Stream],
                stop: threading.Event) -> threading.Thread:  # fmt: skip
    async def worker(client: httpx.AsyncClient, index: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                out.append(await _one(client, url, key, (index + n) % len(PROMPTS), max_tokens))
            except httpx.HTTPError:
                out.append(Stream("", 0, 0, broken=True))
            n += 1

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(worker(client, i) for i in range(workers)))

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


def chaos(model: str, resume: bool, args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    replicas = [engine(model), engine(model)]
    policy = root / "policy.yaml"
    policy.write_text(f"""
backends:
  pool:
    type: engine
    urls: ["{replicas[0].base_url}", "{replicas[1].base_url}"]
    timeouts: {{connect: 0.5, first_token: 30, total: 120, between_tokens: 10}}
    resume_streams: {"on" if resume else "off"}
models:
  local: {{backend: pool, model: {Path(model).name}}}
health: {{interval: 0.5, timeout: 1, breaker: {{consecutive_failures: 3, cooldown: 1}}}}
""")  # fmt: skip
    database = f"sqlite+aiosqlite:///{root / 'g.db'}"
    env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s", "GATEWAY_DATABASE_URL": database}
    gateway = start_gateway(policy, env)
    streams: list[Stream] = []
    stop = threading.Event()
    try:
        key = create_key_cli(env, "bench")
        url = f"{gateway.base_url}/v1/chat/completions"
        uncut = asyncio.run(_uncut(url, key, args.max_tokens))
        thread = run_clients(url, key, args.workers, args.max_tokens, streams, stop)
        for i in (0, 1):  # kill a, restart it; then b
            time.sleep(args.steady)
            replicas[i].proc.send_signal(signal.SIGKILL)
            replicas[i].proc.wait()
            time.sleep(args.down)
            replicas[i] = engine(model, replicas[i].port)
        time.sleep(args.steady)
        stop.set()
        thread.join(120)
        time.sleep(1.0)  # the last rows reach the log
        rows = {r["id"]: r for r in read_log_rows(database)}
    finally:
        gateway.stop()
        for r in replicas:
            if r.proc.poll() is None:
                r.stop()
    report("on " if resume else "off", streams, uncut, rows)


async def _uncut(url: str, key: str, max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [(await _one(client, url, key, i, max_tokens)).text for i in range(len(PROMPTS))]


def report(label: str, streams: list[Stream], uncut: list[str], rows: dict[str, dict]) -> None:
    failed = [s for s in streams if s.status != 200 or s.broken or not s.done or s.text != uncut[s.prompt]]
    resumed = [s for s in streams if rows.get(s.request_id, {}).get("resumptions")]
    steady = [g for s in streams if s not in resumed and s.gaps for g in s.gaps]
    median_gap = statistics.median(steady) if steady else 0.0
    added = sorted(max(s.gaps) - median_gap for s in resumed if s.gaps)

    def pct(q: float) -> float:
        return added[min(len(added) - 1, int(q * len(added)))] * 1e3 if added else float("nan")

    print(f"resume_streams {label}: {len(streams)} streams, failed {len(failed)}, resumed {len(resumed)}; "
          f"added latency of a resumption p50 {pct(0.5):.0f} ms p99 {pct(0.99):.0f} ms "
          f"(median gap between chunks {median_gap * 1e3:.0f} ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--steady", type=float, default=6.0, help="seconds before each kill and at the end")
    parser.add_argument("--down", type=float, default=3.0, help="seconds a killed replica stays dead")
    parser.add_argument("--engine-model", default=None, help="default: the default model")
    args = parser.parse_args()
    model = args.engine_model or str(prepare_default_model())
    for resume in (False, True):
        chaos(model, resume, args)


if __name__ == "__main__":
    main()
