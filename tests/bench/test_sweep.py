"""bench/sweep.py end to end against fake servers: the peak search, the 1x/2x/3x levels, the report."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bench import sweep
from tests.engine.server_proc import ManagedServer

FAKES = Path(__file__).resolve().parent.parent / "fakes"


@pytest.fixture
def capacity_server() -> Iterator[ManagedServer]:
    """Two slots, 50 ms to the first token, 10 ms per token after it: ~16 req/s at 8 tokens."""

    def command(port: int) -> list[str]:
        return [sys.executable, str(FAKES / "capacity_upstream.py"), "--port", str(port), "--slots", "2",
                "--prefill-ms", "50", "--token-ms", "10"]  # fmt: skip

    with ManagedServer(command, ready_timeout=60) as server:
        yield server


def _sweep_args(base_url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--base-url", base_url, "--output-tokens", "8", "--slo-ttft-ms", "300", "--slo-tpot-ms", "50",
        "--start-rate", "4", "--search-duration", "1", "--level-duration", "1", "--min-requests", "5",
        "--search-steps", "1", "--sample-interval", "0.25", "--out", str(out), *extra,
    ]  # fmt: skip


def test_sweep_finds_the_peak_and_shows_overload_at_2x_and_3x(
    capacity_server: ManagedServer, tmp_path: Path
) -> None:
    assert sweep.main(_sweep_args(capacity_server.base_url, tmp_path)) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    # its capacity is ~16.7 req/s: the doubling search from 4 req/s stops within a factor of two of it
    assert 4 <= data["peak_rate"] <= 33
    assert [trial["meets_slo"] for trial in data["search"]][:2] == [True, True]
    assert any(not trial["meets_slo"] for trial in data["search"])
    one, _, three = data["levels"]
    assert [lv["multiplier"] for lv in data["levels"]] == [1, 2, 3]
    assert three["offered_rate"] == pytest.approx(3 * data["peak_rate"], rel=1e-3)
    assert all(lv["sent"] == len(lv["requests"]) >= 5 and lv["failed"] == 0 for lv in data["levels"])
    # past its capacity the queue builds and the SLO is missed: the reason to load-test at 2x and 3x
    assert three["slo_attainment"] < one["slo_attainment"]
    assert three["ttft_p90_ms"] > one["ttft_p90_ms"]
    assert three["max_in_flight"] > one["max_in_flight"]
    assert three["max_server_queue"] > 0  # its engine:num_requests_waiting was scraped
    assert three["throughput_rps"] < 0.8 * three["offered_rate"]
    assert all(r["output_tokens"] == 8 for lv in data["levels"] for r in lv["requests"])  # from usage
    page = (tmp_path / "sweep.html").read_text()
    assert page.count("<svg") == 3  # latency, goodput/errors, queue depth
    # self-contained: no script, stylesheet or image to fetch; links only within the page
    assert not re.search(r"<script|<link|<img|\b(?:src|href)=\"(?!#)", page)
    assert f"{data['peak_rate']:.3f} req/s" in page


def _openai_fake(port: int) -> list[str]:
    return [sys.executable, str(FAKES / "openai_upstream.py"), "--port", str(port)]


def test_a_server_that_fails_every_request_has_no_peak(tmp_path: Path) -> None:
    with ManagedServer(_openai_fake, ready_timeout=60) as server:
        httpx.post(f"{server.base_url}/control", json={"fail_status": 503}).raise_for_status()
        rc = sweep.main(
            _sweep_args(server.base_url, tmp_path, "--start-rate", "8", "--min-rate", "2", "--no-metrics")
        )
    assert rc == 2
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["peak_rate"] is None and data["levels"] == []
    assert [trial["offered_rate"] for trial in data["search"]] == [8, 4, 2]  # halved down to --min-rate
    assert all(trial["errors"] == {"http_503": trial["sent"]} for trial in data["search"])
    assert "No rate tried met the SLO" in (tmp_path / "sweep.html").read_text()


def test_completions_endpoint_counts_tokens_without_usage_and_sends_key_and_model() -> None:
    with ManagedServer(_openai_fake, ready_timeout=60) as server:
        httpx.post(f"{server.base_url}/control", json={"omit_usage": True}).raise_for_status()
        target = sweep.Target(
            base_url=server.base_url, model="fake-model", api_key="sk-test", endpoint="completions",
            input_words=5, output_tokens=4, ignore_eos=False, request_timeout=10,
        )  # fmt: skip

        async def go() -> sweep.Outcome:
            async with httpx.AsyncClient(base_url=target.base_url) as client:
                return await sweep.one_request(client, target, "one two three four five six", 0.0)

        out = asyncio.run(go())
    assert out.ok and out.output_tokens == 4 and out.ttft > 0  # "echo:" + three words, one chunk each
    assert target.body("x")["model"] == "fake-model" and "messages" not in target.body("x")


def _mock(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://upstream")


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"data: {not json\n\n", "bad_stream"),
        (b'data: {"error": {"message": "boom"}}\n\n', "stream_error"),
        (b"data: [DONE]\n\n", "empty"),
    ],
)
def test_broken_streams_are_failures_of_their_own_class(content: bytes, error: str) -> None:
    target = sweep.Target("http://upstream", None, None, "chat", 3, 4, False, 5.0)

    async def go() -> sweep.Outcome:
        async with _mock(lambda request: httpx.Response(200, content=content)) as client:
            return await sweep.one_request(client, target, "hi", 0.0)

    out = asyncio.run(go())
    assert not out.ok and out.error == error


def test_a_request_past_its_timeout_is_a_timeout() -> None:
    target = sweep.Target("http://upstream", None, None, "chat", 3, 4, False, 0.2)

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200)

    async def go() -> sweep.Outcome:
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(slow), base_url="http://upstream"
        ) as client:
            return await sweep.one_request(client, target, "hi", 0.0)

    out = asyncio.run(go())
    assert not out.ok and out.error == "timeout"
