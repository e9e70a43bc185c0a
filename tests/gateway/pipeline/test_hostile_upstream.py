"""The gateway in front of an upstream that misbehaves on purpose (tests/fakes/hostile_upstream.py).

Every misbehaviour, for an engine backend and a hosted one (litellm), whole and streamed: the
client gets a 2xx/4xx or a documented 502/503/504 in OpenAI's format, a stream that started ends
with [DONE] or an error event, each request leaves exactly one log row with believable usage
(bad usage: counted by the gateway, `cost_estimated`), and nothing stays reserved. Then the
exfiltration test: a client's litellm parameters never send the provider key anywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.governance.usage import checked_usage
from tests.fuzz.answers import Answer, problems, row_problems, stream_error
from tests.fuzz.client import chat, post
from tests.fuzz.stack import ENGINE_KEY, PROVIDER_KEY, HostileStack

BAD_USAGE = ["negative", "huge", "int32", "string", "lots", "float", "null", "mismatch", "cached", "bool",
             "list"]  # fmt: skip
MODES = [
    "ok", "bad_utf8", "long_line:2", "truncate", "cut", "reset", "not_json", "json_list", "slow:2",
    "slow:100", "stall", "stall_first", "content_type", "status:500", "status:400", "status:418",
    "status:503", "error_event", "odd_chunk", "shape:no_choices", "shape:content_number",
    *(f"usage:{kind}" for kind in BAD_USAGE),
]  # fmt: skip
ENGINE_ONLY = ["long_line:16", "huge:70"]  # past the engine pool's 8 MiB line and 64 MiB reply bounds
CASES = [(model, mode, stream) for model in ("eng", "host") for mode in MODES for stream in (False, True)]
CASES += [("eng", mode, stream) for mode in ENGINE_ONLY for stream in (False, True)]


def _id(case: tuple[str, str, bool]) -> str:
    model, mode, stream = case
    return f"{model}-{mode}-{'stream' if stream else 'whole'}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    s = HostileStack(tmp_path_factory.mktemp("hostile"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def answers(stack: HostileStack) -> dict[tuple[str, str, bool], Answer]:
    """Every case, sent concurrently once (the slow and stalled ones take the timeouts' seconds)."""

    async def run() -> list[Answer]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            return await asyncio.gather(*(
                post(client, "/v1/chat/completions", stack.key, chat(m, f"say mode={mode}", s, max_tokens=50))
                for m, mode, s in CASES
            ))  # fmt: skip

    return dict(zip(CASES, asyncio.run(run()), strict=True))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_a_misbehaving_upstream_gets_the_client_a_well_formed_answer(
    answers: dict[tuple[str, str, bool], Answer], case: tuple[str, str, bool]
) -> None:
    answer = answers[case]
    assert problems(answer) == []
    assert answer.request_id is not None


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_a_misbehaving_upstream_leaves_one_row_with_believable_usage(
    stack: HostileStack, answers: dict[tuple[str, str, bool], Answer], case: tuple[str, str, bool]
) -> None:
    answer = answers[case]
    assert answer.request_id is not None
    rows = stack.rows_for({answer.request_id})
    assert list(rows) == [answer.request_id], "the request has no log row"
    row = rows[answer.request_id]
    assert row_problems(row) == []
    assert row["status"] == (
        answer.status if not answer.is_stream or stream_error(answer.body) is None else 502
    )
    model, mode, _stream = case
    if mode.startswith("usage:") and row["status"] == 200:
        # The gateway sees an engine's usage as sent: bad usage is counted again and marked. litellm
        # replaces a provider's bad stream usage (and a numeric string) with its own count before we
        # see it: believable numbers, but not marked (docs: security.md, limits of the usage check).
        if model == "eng":
            assert row["cost_estimated"] in (True, 1), "bad upstream usage was billed as reported"
        assert row["prompt_tokens"] is not None and 0 < row["prompt_tokens"] < 1000
        assert row["completion_tokens"] is not None and 0 < row["completion_tokens"] < 1000


@pytest.mark.parametrize("case", [c for c in CASES if c[1].startswith("usage:") and not c[2]], ids=_id)
def test_a_whole_answer_never_relays_usage_the_gateway_did_not_believe(
    answers: dict[tuple[str, str, bool], Answer], case: tuple[str, str, bool]
) -> None:
    answer = answers[case]
    if answer.status != 200:
        return  # refused as a whole (e.g. litellm could not parse it): nothing relayed
    usage = orjson.loads(answer.body).get("usage")
    if usage is not None:  # relayed only when believable: non-negative, bounded, adding up
        assert checked_usage(usage) is not None, usage


def test_every_request_has_exactly_one_row(
    stack: HostileStack, answers: dict[tuple[str, str, bool], Answer]
) -> None:
    ids = [a.request_id for a in answers.values()]
    assert None not in ids and len(set(ids)) == len(ids)
    rows = stack.rows_for({i for i in ids if i is not None})
    assert len(rows) == len(ids)
    all_ids = [r["id"] for r in stack.log_rows()]
    assert len(all_ids) == len(set(all_ids)), "a request was logged twice"


def test_stream_errors_name_no_replica_and_no_provider_text(answers: dict[tuple[str, str, bool], Answer],
                                                            stack: HostileStack) -> None:  # fmt: skip
    for answer in answers.values():
        text = answer.body.decode("utf-8", "replace")
        assert stack.upstream.base_url not in text and "127.0.0.1" not in text
        assert PROVIDER_KEY not in text
        assert "127.0.0.1" not in answer.headers.get("x-gateway-failover", "")


FAILING = ["truncate", "cut", "reset", "not_json", "json_list", "status:500", "status:503", "bad_utf8",
           "content_type", "error_event", "usage:negative", "usage:huge", "usage:lots"]  # fmt: skip


@pytest.mark.parametrize("model", ["eng", "host"])
def test_failed_requests_release_their_budget_and_token_reservations(stack: HostileStack, model: str) -> None:
    # Each request reserves $0.008 (4000 tokens at $2/M) and 4000+ tokens: three leaked
    # reservations would exhaust the $0.02 budget, five the 20k tokens per minute.
    key = stack.create_key(name=f"small-{model}", budget_usd=0.02, tpm_limit=20_000)

    answers = []
    for mode in FAILING:
        for stream in (False, True):
            answer = asyncio.run(_one(stack, key, chat(model, f"mode={mode}", stream, max_tokens=4000)))
            answers.append(answer)
            if answer.request_id:  # released with its row: the next request starts after it (a loaded
                stack.rows_for({answer.request_id})  # machine may write the row after the answer)
    assert [problems(a) for a in answers] == [[] for _ in answers]
    assert all(a.status != 429 for a in answers), [a.body for a in answers if a.status == 429]
    stack.rows_for({a.request_id for a in answers if a.request_id})  # every row finished: all released
    last = asyncio.run(_one(stack, key, chat(model, "mode=ok", False, max_tokens=4000)))
    assert last.status == 200, last.body


async def _one(stack: HostileStack, key: str, body: dict[str, object]) -> Answer:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        return await post(client, "/v1/chat/completions", key, body)


LITELLM_PARAMS = ["api_base", "base_url", "extra_headers", "mock_response", "fallbacks", "model_list",
                  "custom_llm_provider", "num_retries", "api_key", "metadata", "extra_body", "headers",
                  "api_version", "organization", "azure_ad_token", "aws_secret_access_key"]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_litellm_parameters_never_send_the_provider_key_elsewhere(
    stack: HostileStack, stream: bool
) -> None:
    evil = f"{stack.attacker.base_url}/v1"
    body = chat(
        "host", f"exfiltrate {stream}", stream,
        api_base=evil, base_url=evil, extra_headers={"x-evil": "1", "authorization": "Bearer sk-client"},
        mock_response="pwned", fallbacks=[{"model": "openai/x", "api_base": evil}],
        model_list=[{"model_name": "host", "litellm_params": {"model": "openai/x", "api_base": evil}}],
        custom_llm_provider="openai", num_retries=3, api_key="sk-client-chosen",
        metadata={"api_base": evil}, extra_body={"api_base": evil}, headers={"x-evil": "1"},
        api_version="evil", organization="evil-org", azure_ad_token="t", aws_secret_access_key="k",
    )  # fmt: skip
    before = len(stack.received())
    answer = asyncio.run(_one(stack, stack.key, body))
    assert problems(answer) == [] and answer.status == 200
    assert b"pwned" not in answer.body
    assert stack.received(stack.attacker) == [], "the attacker's server was called"
    received = stack.received()[before:]
    assert len(received) == 1, received
    (request,) = received
    assert request["headers"]["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert "x-evil" not in request["headers"] and "sk-client" not in str(request["headers"])
    assert "openai-organization" not in request["headers"]
    forwarded = request["body"]
    for name in LITELLM_PARAMS:
        assert f'"{name}"' not in forwarded, f"{name} reached the provider"
    assert evil not in forwarded and "sk-client" not in forwarded


def test_engine_backend_never_calls_a_client_chosen_url(stack: HostileStack) -> None:
    evil = f"{stack.attacker.base_url}/v1"
    body = chat("eng", "route me", False, api_base=evil, base_url=evil, extra_headers={"x-evil": "1"})
    answer = asyncio.run(_one(stack, stack.key, body))
    assert answer.status == 200 and stack.received(stack.attacker) == []


def test_the_gateway_still_answers_and_exits_cleanly_after_the_hostile_cases(
    tmp_path: Path, postgres_url: str
) -> None:
    """The same misbehaviours on PostgreSQL (one row each, believable usage), then a clean exit."""
    stack = HostileStack(tmp_path, postgres_url, total_timeout=3.0)
    try:
        cases = [(m, mode, s) for m in ("eng", "host") for mode in FAILING for s in (False, True)]

        async def run() -> list[Answer]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                return await asyncio.gather(*(
                    post(client, "/v1/chat/completions", stack.key, chat(m, f"mode={mode}", s))
                    for m, mode, s in cases
                ))  # fmt: skip

        answers = asyncio.run(run())
        assert [problems(a) for a in answers] == [[] for _ in answers]
        ids = {a.request_id for a in answers if a.request_id}
        assert len(ids) == len(cases)
        rows = stack.rows_for(ids)
        assert len(rows) == len(cases)
        assert [row_problems(r) for r in rows.values()] == [[] for _ in rows]
        assert asyncio.run(_one(stack, stack.key, chat("eng", "mode=ok"))).status == 200
    finally:
        assert stack.close() == 0


def test_a_stream_opening_with_oddly_shaped_chunks_is_relayed_not_failed(
    answers: dict[tuple[str, str, bool], Answer],
) -> None:
    # The first-token check used to raise on `"choices": 7` or a string delta: a 502 for a stream
    # that was fine to relay (gateway/pipeline/stream_start.py `_has_token`).
    answer = answers[("eng", "odd_chunk", True)]
    assert answer.status == 200 and answer.body.endswith(b"data: [DONE]\n\n")
    # ... and the misshapen events are not the client's: the SDKs' `for c in chunk.choices` raises
    assert b'"choices":7' not in answer.body and b'"delta":"text"' not in answer.body
    assert b"echo:" in answer.body  # the rest of the stream went on


def test_the_client_never_gets_a_usage_the_gateway_does_not_believe(stack: HostileStack) -> None:
    body = chat("eng", "mode=two_usage", True, stream_options={"include_usage": True})
    answer = asyncio.run(_one(stack, stack.key, body))
    assert answer.status == 200 and problems(answer) == []
    usages = [orjson.loads(line[6:])["usage"] for line in answer.body.split(b"\n")
              if line.startswith(b"data: {") and b'"usage":{' in line]  # fmt: skip
    assert usages == [{"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}]  # not the 2**40 one


def test_an_upstream_500_or_a_non_json_error_reaches_the_client_as_an_openai_error(
    answers: dict[tuple[str, str, bool], Answer],
) -> None:
    for stream in (False, True):
        for model in ("eng", "host"):
            assert answers[(model, "status:500", stream)].status == 502  # a bad gateway, never a 500
        assert answers[("eng", "status:503", stream)].status == 503
        teapot = answers[("eng", "status:418", stream)]
        assert teapot.status == 418 and teapot.headers["content-type"] == "application/json"
        assert teapot.body.startswith(b'{"error":{"message":"the upstream for \'eng\' answered HTTP 418"')


def test_a_stream_event_that_is_not_a_json_object_ends_the_stream_with_an_error_event(
    answers: dict[tuple[str, str, bool], Answer],
) -> None:
    for mode in ("not_json", "json_list"):
        error = stream_error(answers[("eng", mode, True)].body)
        assert error is not None and error["code"] == "upstream_stream_error"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stalled_hosted_provider_is_called_once_and_answered_504_within_its_timeout(
    stack: HostileStack, stream: bool
) -> None:
    # The provider's SDK retried a timeout twice by itself: 3 calls and 3x the policy's 6 s.
    token = f"stalled-{stream}"
    started = time.monotonic()
    answer = asyncio.run(_one(stack, stack.key, chat("host", f"{token} mode=stall_first", stream)))
    elapsed = time.monotonic() - started
    assert answer.status == 504 and problems(answer) == []
    assert sum(token in r["body"] for r in stack.received()) == 1
    assert elapsed < 12


def test_an_upstream_trickling_its_answer_is_cut_at_the_total_timeout(
    answers: dict[tuple[str, str, bool], Answer],
) -> None:
    # A byte every 100 ms: the provider client's own timeout bounds each read, so a hosted answer
    # trickled in over 32 s (a 200) past the policy's 6 s total, until the deadline covered it all.
    for model in ("eng", "host"):
        assert answers[(model, "slow:100", False)].status == 504


def test_a_hosted_request_with_many_messages_does_not_stall_other_requests(stack: HostileStack) -> None:
    async def run() -> float:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            many = chat("host", "x", False)
            # a 120 KB body: 0.6-2.3 s of litellm's work on our VMs, under the stack's 6 s total (10,000
            # messages took 5.6-6+ s on a slow one), and far past the 0.25 s a stall would show
            many["messages"] = [{"role": "user", "content": "x"}] * 4_000
            task = asyncio.create_task(post(client, "/v1/chat/completions", stack.key, many))
            worst = 0.0
            await asyncio.sleep(0.2)
            while not task.done():
                started = time.monotonic()
                await client.get("/health")
                worst = max(worst, time.monotonic() - started)
                await asyncio.sleep(0.02)
            assert (await task).status == 200
            return worst

    assert asyncio.run(run()) < 0.25


def test_a_stream_that_ends_right_after_its_role_chunk_ends_cleanly(stack: HostileStack) -> None:
    # [DONE] arrives while the failover still reads the head: a complete (empty) answer, not a cut
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "empty-stream mode=empty", True)))
    assert answer.status == 200 and problems(answer) == []
    assert stream_error(answer.body) is None and answer.body.rstrip().endswith(b"data: [DONE]")
    assert answer.request_id is not None
    assert stack.rows_for({answer.request_id})[answer.request_id]["status"] == 200


def _row(stack: HostileStack, answer: Answer) -> dict[str, object]:
    assert answer.request_id is not None
    return stack.rows_for({answer.request_id})[answer.request_id]


def test_a_stream_answered_with_an_html_page_is_a_failure_nothing_of_which_reaches_the_client(
    stack: HostileStack,
) -> None:
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=html", True)))
    assert answer.status == 502 and problems(answer) == []
    assert b"<html" not in answer.body and b"10.9.8.7" not in answer.body
    assert _row(stack, answer)["status"] == 502


def test_nothing_after_done_reaches_the_client_or_the_bill(stack: HostileStack) -> None:
    answer = asyncio.run(
        _one(stack, stack.key, chat("eng", "mode=after_done", True, stream_options={"include_usage": True}))
    )
    assert answer.status == 200 and problems(answer) == []
    assert b"INJECTED" not in answer.body and answer.body.count(b"data: [DONE]") == 1
    row = _row(stack, answer)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 3)
    assert row["cost_estimated"] in (False, 0)


def test_an_unbelievable_usage_chunk_leaves_the_believable_one_before_it(stack: HostileStack) -> None:
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=two_usage", True)))
    assert answer.status == 200 and problems(answer) == []
    row = _row(stack, answer)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_estimated"]) in (
        (5, 3, False),
        (5, 3, 0),
    )


def test_a_first_token_that_breaks_the_stream_leaves_the_client_its_role_chunk(stack: HostileStack) -> None:
    # the head's role chunk used to be dropped with the broken line after it: a stream resumed
    # elsewhere sends none of its own, and here (no other replica) the client got the error alone
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=first_not_json", True)))
    assert answer.status == 200 and problems(answer) == []
    events = [line for line in answer.body.split(b"\n") if line.startswith(b"data:")]
    assert len(events) == 2 and b'"role":"assistant"' in events[0] and stream_error(answer.body) is not None
    assert _row(stack, answer)["status"] == 502


def test_a_stream_of_role_chunks_without_a_token_is_a_failure_not_held_in_memory(stack: HostileStack) -> None:
    # the head went with the first role chunk (policy `stream_head: first_event`), and that chunk
    # with it; the failure is the stream's next and last event: no other role chunk reaches the client
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=role_spam", True)))
    assert answer.status == 200 and problems(answer) == [] and answer.body.count(b'"role"') == 1
    events = [line for line in answer.body.split(b"\n") if line.startswith(b"data:")]
    assert len(events) == 2 and b'"role"' in events[0]
    error = stream_error(answer.body)
    assert error is not None and error["code"] == "upstream_unavailable"
    assert _row(stack, answer)["status"] == 502


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_response_head_that_never_ends_is_refused_at_its_bound(stack: HostileStack, stream: bool) -> None:
    start = time.monotonic()
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=huge_head", stream)))
    assert answer.status == 502 and problems(answer) == []
    assert time.monotonic() - start < 3  # refused at 64 KiB, not at the total timeout


def test_an_engines_error_reaches_the_client_as_its_four_fields_without_urls(stack: HostileStack) -> None:
    client_error = asyncio.run(_one(stack, stack.key, chat("eng", "mode=error_leak:400", False)))
    assert client_error.status == 400
    body = orjson.loads(client_error.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "10.0.0.5" not in body["error"]["message"] and "[url]" in body["error"]["message"]
    # the replica's address, bare, and another address of the upstream's network: never the client's
    assert "127.0.0.1" not in body["error"]["message"] and "10.0.3.17" not in body["error"]["message"]
    assert "replica [hidden]" in body["error"]["message"], body
    assert body["error"]["code"] == "bad_thing"
    server_error = asyncio.run(_one(stack, stack.key, chat("eng", "mode=error_leak:503", False)))
    assert server_error.status == 503
    error = orjson.loads(server_error.body)["error"]
    assert "internal" not in error["message"] and error["message"].startswith("the upstream for 'eng'")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["eng", "host"])
def test_an_upstream_that_echoes_our_key_in_its_error_never_hands_it_to_the_client(
    stack: HostileStack, model: str, stream: bool
) -> None:
    # was: an engine answering 400 "invalid key presented: Bearer <the pool's key>" had the key relayed
    # (whole, and as a mid-stream invalid_request_error event); only the hosted backend masked its own
    answer = asyncio.run(_one(stack, stack.key, chat(model, "mode=echo_auth", stream)))
    assert problems(answer) == []
    assert ENGINE_KEY not in answer.body.decode() and PROVIDER_KEY not in answer.body.decode()
    if (model, stream) != ("host", True):  # (litellm's stream error is never relayed: a generic one)
        assert "invalid key presented: " in answer.body.decode() and "[hidden]" in answer.body.decode()
    if not stream:
        assert answer.status == 400


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_a_hosted_providers_redirect_is_never_followed(stack: HostileStack, code: int, stream: bool) -> None:
    # was: litellm's client (and the SDK's on it) followed a 307 to any host with the client's prompt,
    # and relayed that host's answer as a 200
    port = httpx.URL(stack.attacker.base_url).port
    content = f"mode=redirect:{code}_{port} redirected-prompt-{code}-{stream}"
    answer = asyncio.run(_one(stack, stack.key, chat("host", content, stream)))
    assert stack.received(stack.attacker) == [], "the redirect was followed"
    assert answer.status == 502 and problems(answer) == []
    assert str(port) not in answer.body.decode()


def test_a_stream_past_64_mib_ends_with_an_error_and_a_bounded_estimate(stack: HostileStack) -> None:
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=big_stream:66", True)))
    assert answer.status == 200 and problems(answer) == []
    assert stream_error(answer.body) is not None
    row = _row(stack, answer)
    assert row["status"] == 502
    assert isinstance(row["completion_tokens"], int) and row["completion_tokens"] <= 1 << 24


def test_a_hosted_stream_line_past_8_mib_is_cut_off_as_an_engines_is(stack: HostileStack) -> None:
    """litellm's SSE reader held a line until it ended: a provider's line of gigabytes was held
    whole (bounded_body.bound_stream)."""
    answer = asyncio.run(_one(stack, stack.key, chat("host", "mode=long_line:9", True)))
    assert problems(answer) == []
    assert answer.status == 502 or stream_error(answer.body) is not None
    assert b"zzzz" not in answer.body
    assert _row(stack, answer)["status"] == 502


@pytest.mark.parametrize("model", ["eng", "host"])
def test_a_legacy_completion_stream_that_stalls_ends_within_its_total_timeout(
    stack: HostileStack, model: str
) -> None:
    """litellm's text-completion stream, given the gateway's bounded client, applied no timeout at
    all: a stalled provider held the request (and its client) for ever."""

    async def ask() -> tuple[Answer, float]:
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            body = {"model": model, "prompt": "mode=stall", "stream": True, "max_tokens": 20}
            answer = await post(client, "/v1/completions", stack.key, body)
        return answer, time.monotonic() - started

    answer, seconds = asyncio.run(ask())
    assert answer.status == 200 and problems(answer) == [] and stream_error(answer.body) is not None
    assert seconds < 15  # the stack's total timeout is 6 s
    assert _row(stack, answer)["status"] == 502


def test_a_usage_that_comes_before_most_of_the_answer_does_not_bill_it(stack: HostileStack) -> None:
    """A small believable usage early, then 400 more words and no usage: billed 3 tokens before."""
    answer = asyncio.run(_one(stack, stack.key, chat("eng", "mode=early_usage", True)))
    assert answer.status == 200 and problems(answer) == []
    row = _row(stack, answer)
    assert row["completion_tokens"] >= 400 and row["cost_estimated"] in (True, 1)


@pytest.mark.parametrize("mode", ["cut", "reset"])
def test_a_hosted_chat_stream_that_breaks_off_is_never_relayed_as_a_whole_answer(
    answers: dict[tuple[str, str, bool], Answer], mode: str
) -> None:
    # litellm's stream wrapper ends a provider stream that broke off with a finish of its own
    # ("stop"): the client saw a short answer as a whole one, and the row billed it as such
    answer = answers[("host", mode, True)]
    assert problems(answer) == [] and b"data: [DONE]" not in answer.body
    if answer.status == 200:  # the client had part of it: the stream ends with an error event
        assert stream_error(answer.body) is not None
    else:  # it broke before anything reached the client (litellm held its first chunk back)
        assert answer.status == 502 and b"upstream_unavailable" in answer.body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("wait", "told"),
    [("7", "7"), ("0", "0"), ("99999", "3600"), ("date", None), ("soon", None), ("none", None)],
)
def test_a_providers_429_reaches_the_client_with_its_retry_after_in_bounded_seconds_only(
    stack: HostileStack, stream: bool, wait: str, told: str | None
) -> None:
    # `host` is the only model of its chain: its 429 is the client's; an HTTP-date or text is dropped
    answer = asyncio.run(_one(stack, stack.key, chat("host", f"mode=rate_limited:{wait}", stream)))
    assert answer.status == 429 and problems(answer) == []
    assert answer.headers.get("retry-after") == told
    assert _row(stack, answer)["status"] == 429


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("wait", "told"), [("2", "2"), ("99999", "3600"), ("date", None), ("none", None)])
def test_an_overloaded_engines_retry_after_reaches_the_client_with_its_503(
    stack: HostileStack, stream: bool, wait: str, told: str | None
) -> None:
    # the engine's replica (the only one) at its request limit says when to come back: the client's
    # 503, once no other candidate served, says so too (it said nothing)
    answer = asyncio.run(_one(stack, stack.key, chat("eng", f"mode=overloaded:{wait}", stream)))
    assert answer.status == 503 and problems(answer) == []
    assert answer.headers.get("retry-after") == told
    assert _row(stack, answer)["status"] == 503


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_providers_529_overload_reaches_the_client_as_a_503(stack: HostileStack, stream: bool) -> None:
    answer = asyncio.run(_one(stack, stack.key, chat("host", "mode=status:529", stream)))
    assert answer.status == 503 and problems(answer) == []
    assert b"provider_500" not in answer.body and b"exploded" not in answer.body
    assert _row(stack, answer)["status"] == 503


@pytest.mark.parametrize("mode", ["huge:70", "huge_chunked:70"])
def test_a_hosted_whole_answer_past_64_mib_is_cut_at_its_bound_and_answered_502(
    stack: HostileStack, mode: str
) -> None:
    # litellm read a provider's whole answer into memory whatever its size, and relayed it. Three
    # leaked reservations ($0.008 each) would exhaust the key's $0.02 budget: the last call shows none.
    key = stack.create_key(name=f"huge-{mode}", budget_usd=0.02, tpm_limit=20_000)
    for _ in range(3):
        answer = asyncio.run(_one(stack, key, chat("host", f"mode={mode}", False, max_tokens=4000)))
        assert answer.status == 502 and problems(answer) == []
        assert len(answer.body) < 1000 and b"xxxx" not in answer.body
        assert orjson.loads(answer.body)["error"]["code"] == "upstream_unavailable"
        assert _row(stack, answer)["status"] == 502
        assert [row["id"] for row in stack.log_rows()].count(answer.request_id) == 1
    last = asyncio.run(_one(stack, key, chat("host", "mode=ok", False, max_tokens=4000)))
    assert last.status == 200, last.body


@pytest.mark.parametrize("mode", ["stall", "slow:100"])
def test_the_time_spent_waiting_on_a_stalled_or_slow_engine_stream_is_the_upstream_s_not_overhead(
    stack: HostileStack, answers: dict[tuple[str, str, bool], Answer], mode: str
) -> None:
    # a stream cut off after seconds of silence (its total timeout) or read a byte at a time: the
    # gateway's own share of its time (overhead_ms: the row, /metrics) stays that of its work
    answer = answers[("eng", mode, True)]
    assert answer.request_id is not None
    row = stack.rows_for({answer.request_id})[answer.request_id]
    assert row["latency_ms"] > 1000
    assert row["overhead_ms"] < 200, (row["latency_ms"], row["overhead_ms"])
