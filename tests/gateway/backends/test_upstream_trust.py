"""What the gateway takes from a client into a provider call, and from an upstream into the books.

The client's body reaches litellm only through an allow-list; an upstream's usage is billed only
when believable; reservations cover every answer a request asks for. (An engine's SSE lines, split
with a bound and never broken by bytes that are not UTF-8: tests/gateway/backends/test_wire.py.)
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import httpx
import litellm
import orjson
import pytest

from gateway.api.completions import CompletionsEndpoint
from gateway.backends.base import UpstreamUnavailableError
from gateway.backends.hosted import HostedModel, allowed_fields
from gateway.backends.hosted_shapes import openai_chunk
from gateway.backends.upstream_errors import reduced_fields
from gateway.config.policy import HostedBackend, parse_policy
from gateway.errors import GatewayError
from gateway.governance.costs import PriceBook
from gateway.governance.keys import KeyInfo
from gateway.governance.usage import MAX_TOKENS, PROMPT_SLACK, checked_usage, choices, max_output, max_prompt
from gateway.pipeline.admission import Admission, Ticket
from gateway.pipeline.failover import Failover
from gateway.pipeline.reply import Reply, error_reply
from gateway.pipeline.runtime import Runtime
from gateway.routing.router import Router
from gateway.telemetry.trace import NO_TRACING

# litellm keyword arguments that must never come from a client (each one was passed through once)
LITELLM_ONLY = {
    "api_base": "http://127.0.0.1:1/steal", "base_url": "http://127.0.0.1:1/steal", "api_key": "sk-client",
    "extra_headers": {"x": "y"}, "mock_response": "free", "fallbacks": ["x"], "model_list": [{}],
    "custom_llm_provider": "openai", "num_retries": 100, "metadata": {"a": 1}, "extra_body": {"b": 2},
    "api_version": "x", "timeout": 1e9, "headers": {"h": "v"}, "litellm_params": {}, "caching": True,
}  # fmt: skip


def test_hosted_calls_take_only_openai_fields_from_the_client() -> None:
    model = HostedModel("frontier", HostedBackend(type="hosted", model="openai/gpt-4o-mini",
                                                  api_key_env="SWITCHBOARD_TEST_PROVIDER_KEY"))  # fmt: skip
    model._api_key = "sk-provider"
    body = {"model": "openai/gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5, "tools": [], **LITELLM_ONLY}  # fmt: skip
    name, params = model._kwargs("/v1/chat/completions", orjson.dumps(body), True, None)
    assert name == "openai/gpt-4o-mini"
    assert not set(LITELLM_ONLY) - {"api_key", "timeout"} & set(params)
    assert params["api_key"] == "sk-provider" and params["timeout"] == model.spec.timeouts.total
    assert "base_url" not in params and "api_base" not in params  # the policy set none: litellm's default
    assert params["temperature"] == 0.5 and params["stream"] is True


def test_a_provider_never_reached_is_unreachable_not_a_provider_500() -> None:
    """litellm reports a refused connection as an InternalServerError whose causes hold it."""
    model = HostedModel("frontier", HostedBackend(type="hosted", model="openai/x"))

    def wrapped(cause: BaseException) -> Exception:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise litellm.exceptions.InternalServerError("Connection error.", "openai", "x") from inner
        except Exception as outer:
            return outer

    refused = wrapped(httpx.ConnectError("All connection attempts failed"))
    with pytest.raises(UpstreamUnavailableError) as info:
        model._error(refused)
    assert not info.value.timeout and info.value.deployment == "openai/x"
    with pytest.raises(UpstreamUnavailableError) as info:
        model._error(wrapped(ConnectionRefusedError()))
    assert not info.value.timeout
    with pytest.raises(UpstreamUnavailableError) as info:
        model._error(wrapped(httpx.ReadTimeout("slow")))
    assert info.value.timeout
    answered = litellm.exceptions.InternalServerError("boom", "openai", "x")  # the provider's own 500
    reply = model._error(answered)
    assert reply.status == 500 and orjson.loads(reply.body)["error"]["code"] == "provider_500"


def test_a_provider_error_that_echoes_our_key_or_host_reaches_the_client_without_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider's 400 message is passed on (it says what to change), but one echoing the
    Authorization header or naming its own host handed the gateway's provider key to the client;
    the gateway's own log line of it carried the key too, and the host's port stayed."""
    monkeypatch.setenv("SWITCHBOARD_TEST_ECHOED_KEY", "sk-provider-secret-1234")
    spec = HostedBackend(type="hosted", model="openai/x", api_key_env="SWITCHBOARD_TEST_ECHOED_KEY",
                         base_url="http://llm-proxy.corp.internal:8443/v1")  # fmt: skip
    model = HostedModel("frontier", spec)
    message = ("max_tokens is too large (got Authorization: Bearer sk-provider-secret-1234 via "
               "LLM-PROXY.corp.internal:8443)")  # fmt: skip
    refused = litellm.exceptions.BadRequestError(
        message, "x", "openai", body={"message": message, "param": "sk-provider-secret-1234", "code": "bad"}
    )
    reply = model._error(refused)
    error = orjson.loads(reply.body)["error"]
    assert reply.status == 400 and error["code"] == "bad"
    assert error["message"].startswith("max_tokens is too large")  # what to change is still said
    for secret in ("sk-provider-secret", "llm-proxy", "LLM-PROXY", "8443"):
        assert secret not in reply.body.decode()
        assert secret not in caplog.text
    assert "hosted model openai/x failed" in caplog.text


def test_a_provider_error_litellm_left_as_text_is_passed_on_as_the_providers() -> None:
    """Anthropic's 400 reached litellm's exception only as text: the client got "the provider of
    ... refused the request", not what to change."""
    model = HostedModel("claude", HostedBackend(type="hosted", model="anthropic/claude-haiku-4-5"))
    text = ('AnthropicException - {"type":"error","error":{"type":"invalid_request_error",'
            '"message":"max_tokens: Field required"}} Received Model Group=x')  # fmt: skip
    reply = model._error(litellm.exceptions.BadRequestError(text, "claude", "anthropic"))
    error = orjson.loads(reply.body)["error"]
    assert reply.status == 400 and error["message"] == "max_tokens: Field required", error
    quoted = "AnthropicException - b'" + '{"error": {"message": "the model\\\'s limit \\xc3\\xa9"}}' + "'"
    reply = model._error(litellm.exceptions.BadRequestError(quoted, "claude", "anthropic"))  # a stream's
    assert orjson.loads(reply.body)["error"]["message"] == "the model's limit é"
    unreadable = litellm.exceptions.BadRequestError("AnthropicException - {not json", "claude", "anthropic")
    error = orjson.loads(model._error(unreadable).body)["error"]
    assert error["message"] == "the provider of anthropic/claude-haiku-4-5 refused the request"


def test_a_refusal_litellm_moves_aside_is_the_answers_own_field_again() -> None:
    """litellm puts OpenAI's message.refusal in provider_specific_fields, which is dropped: the
    client got an empty assistant message."""
    from gateway.backends.hosted_shapes import without_litellm_fields

    answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None,
        "provider_specific_fields": {"refusal": "I can't help with that."}}}]}  # fmt: skip
    message = without_litellm_fields(answer)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "refusal": "I can't help with that."}


def test_a_policy_base_url_is_the_only_one_a_hosted_call_uses() -> None:
    spec = HostedBackend(type="hosted", model="openai/x", base_url="http://provider.internal/v1")
    _, params = HostedModel("p", spec)._kwargs(
        "/v1/completions", orjson.dumps({"model": "openai/x", "prompt": "a", **LITELLM_ONLY}), False, None
    )
    assert params["base_url"] == "http://provider.internal/v1" and "api_base" not in params
    assert set(params) <= {"prompt", "base_url", "api_key", "timeout", "max_retries"}
    assert params["max_retries"] == 0  # retries are the failover's, not the provider SDK's


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_allow_list_keeps_every_documented_openai_field(path: str) -> None:
    chat = {"messages": [], "tools": [], "tool_choice": "auto", "response_format": {}, "top_logprobs": 2,
            "max_completion_tokens": 5, "parallel_tool_calls": False, "reasoning_effort": "low"}  # fmt: skip
    text = {"prompt": "x", "echo": True, "suffix": "s", "best_of": 2}
    common = {"model": "m", "n": 2, "stop": ["x"], "seed": 1, "logit_bias": {}, "user": "u", "top_p": 1}
    own = chat if path.endswith("chat/completions") else text
    assert allowed_fields({**common, **own, **LITELLM_ONLY}, path) == {**common, **own}


@pytest.mark.parametrize("usage", [
    None, "lots", 7, [], {}, {"prompt_tokens": -5, "completion_tokens": 3},
    {"prompt_tokens": 1 << 40, "completion_tokens": 1}, {"prompt_tokens": "3", "completion_tokens": 1},
    {"prompt_tokens": 3.0, "completion_tokens": 1}, {"prompt_tokens": True, "completion_tokens": 1},
    {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 9},
    {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}},
    {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": -1}},
    {"prompt_tokens": MAX_TOKENS + 1, "completion_tokens": 0},
])  # fmt: skip
def test_unbelievable_usage_is_not_billed(usage: Any) -> None:
    assert checked_usage(usage) is None


def test_more_prompt_tokens_than_the_request_holds_are_not_billed() -> None:
    """A provider billed a 60-byte question as 900,000 prompt tokens (believable as a count): 18x
    its key's budget, the key locked out. A prompt cannot hold more tokens than bytes, plus slack
    for templates and a provider's preamble; an image, audio or a file is worth more than its bytes."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "two plus two?"}]}
    assert checked_usage({"prompt_tokens": 900_000, "completion_tokens": 2}, body) is None
    assert checked_usage({"prompt_tokens": 1_000, "completion_tokens": 2}, body) is not None
    # the size as received bounds it when given (the body re-encoded is a pass over it on the loop)
    assert checked_usage({"prompt_tokens": 9_000, "completion_tokens": 2}, body, 10_000) is not None
    assert checked_usage({"prompt_tokens": 9_000, "completion_tokens": 2}, body, 100) is None
    huge = {"prompt_tokens": 900_000, "completion_tokens": 2}
    assert checked_usage(huge) is not None  # no request: no bound
    text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "two plus two?"}]}]}
    assert checked_usage({"prompt_tokens": 900_000, "completion_tokens": 2}, text_parts) is None
    image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
    ]}]}  # fmt: skip
    assert checked_usage({"prompt_tokens": 900_000, "completion_tokens": 2}, image) is not None
    searched = {**body, "web_search_options": {}}  # the pages the provider read are its input too
    assert checked_usage({"prompt_tokens": 900_000, "completion_tokens": 2}, searched) is not None
    # a prompt is counted once however many answers it gets (OpenAI, vLLM, our engine): n does not
    # multiply what a prompt may hold (it let a 2 KB request with n=8 be billed 16,000 prompt tokens)
    long = {"messages": [{"role": "user", "content": "word " * 20_000}], "n": 8}
    size = len(orjson.dumps(long))
    at_most = {"prompt_tokens": size + PROMPT_SLACK, "completion_tokens": 8}
    assert checked_usage(at_most, long, size) is not None
    assert checked_usage({"prompt_tokens": 2 * size, "completion_tokens": 8}, long, size) is None


def test_a_provider_run_tool_may_bill_more_prompt_than_the_request_holds() -> None:
    """A hosted tool the provider runs itself (Anthropic's web_search, web_fetch, code execution, an
    MCP server; Gemini's googleSearch) feeds what it read back as input tokens: a 200-byte question
    with web_search is truly billed tens of thousands of them (was rejected: billed as estimated,
    the search's tokens free). Functions the client runs add nothing but their own bytes."""
    question = {"role": "user", "content": "what happened today?"}
    usage = {"prompt_tokens": 40_000, "completion_tokens": 300}
    provider_run: list[dict[str, Any]] = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "mcp", "server_url": "https://mcp.example/sse", "name": "docs"},
        {"googleSearch": {}},
    ]
    for tool in provider_run:
        assert checked_usage(usage, {"model": "m", "messages": [question], "tools": [tool]}) is not None
    function = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert checked_usage(usage, {"model": "m", "messages": [question], "tools": [function]}) is None


def test_believable_usage_is_normalised() -> None:
    raw = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "extra": "x",
           "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0}}  # fmt: skip
    assert checked_usage(raw) == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                  "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert checked_usage({"prompt_tokens": 1, "completion_tokens": 2}) == {
        "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}  # fmt: skip


POLICY = """
backends:
  local: {type: engine, urls: ["http://127.0.0.1:9"], price: {input_per_mtok: 1, output_per_mtok: 2}}
  openai: {type: hosted, model: openai/gpt-4o-mini}
  anthropic: {type: hosted, model: anthropic/claude}
models:
  fast: {backend: local, fallbacks: [gpt, claude]}
  gpt: {backend: openai, fallbacks: [claude]}
  claude: {backend: anthropic}
routes:
  auto: {candidates: [fast], fallbacks: [claude]}
"""


def _key(allowed: list[str] | None, tpm: int | None = None) -> KeyInfo:
    return KeyInfo("k1", "n", "sk-x", None, allowed, {}, datetime.now(UTC), None, None, None, tpm_limit=tpm)


def test_fallbacks_a_key_may_not_call_are_never_reached() -> None:
    router = Router(parse_policy(POLICY))
    assert router.decide("fast", {}, _key(["fast"])).chain == ("fast",)
    assert router.decide("fast", {}, _key(["fast", "claude"])).chain == ("fast", "claude")
    assert router.decide("fast", {}, _key(None)).chain == ("fast", "gpt", "claude")
    assert router.decide("auto", {}, _key(["auto"])).chain == ("fast", "claude")  # the route is the grant


def test_reservations_cover_every_answer_asked_for() -> None:
    prices = PriceBook(parse_policy(POLICY))
    one = prices.worst_case(("fast",), {"max_tokens": 100}, 400)
    prompt = 400 * Decimal(1) / 10**6  # a token per body byte: a token is at least one byte
    assert one == prompt + 100 * Decimal(2) / 10**6
    assert prices.worst_case(("fast",), {"max_tokens": 100, "n": 4}, 400) == prompt + 4 * (one - prompt)
    huge = prices.worst_case(("fast",), {"max_tokens": 10**30, "n": 10**9}, 400)
    assert huge <= MAX_TOKENS * 128 * Decimal(2) / 10**6 + prompt  # clamped: stays a number Redis can count
    ticket = Ticket()
    limits = Admission._limits(_runtime(), _key(None, tpm=10**9), {"max_tokens": 50, "n": 3}, 400, ticket)
    assert ticket.reserved_tokens == 100 + 150 and all(lim.cost == 250 for lim in limits)
    # a legacy completion's list of prompts: each prompt gets its n answers (32 x 16 tokens here)
    many = {"max_tokens": 16, "prompt": ["p"] * 32}
    assert prices.worst_case(("fast",), many, 400) == prompt + 32 * 16 * Decimal(2) / 10**6
    assert prices.worst_case(("fast",), {**many, "n": 2}, 400) == prompt + 64 * 16 * Decimal(2) / 10**6
    assert (
        prices.worst_case(("fast",), {"max_tokens": 16, "prompt": [1, 2, 3]}, 400)
        == one - 84 * Decimal(2) / 10**6
    )
    Admission._limits(_runtime(), _key(None, tpm=10**9), many, 400, ticket := Ticket())
    assert ticket.reserved_tokens == 100 + 32 * 16
    # no max_tokens: a self-hosted model may answer up to the rest of its context
    assert prices.worst_case(("fast",), {}, 400, lambda m: 8192) == prompt + 8192 * Decimal(2) / 10**6
    assert prices.worst_case(("fast",), {}, 400) == prompt + 4096 * Decimal(2) / 10**6  # context unknown


def _runtime() -> Runtime:
    policy = parse_policy(POLICY)
    prices = PriceBook(policy)
    return Runtime(policy, Router(policy), Failover(policy, {}), {}, "t", datetime.now(UTC), prices)


class _BrokenKeys:
    async def authenticate(self, presented: str | None, client: object = None) -> KeyInfo:
        raise RuntimeError("postgresql://user:secret@10.0.0.5/db exploded")


class _Refusals:
    tracing = NO_TRACING

    def refuse(self, started: float, exc: GatewayError, trace: object) -> Reply:
        return error_reply(exc)


def test_an_unexpected_failure_before_the_proxy_is_an_openai_503_without_its_text() -> None:
    services = lambda: SimpleNamespace(keys=_BrokenKeys(), proxy=_Refusals())  # noqa: E731
    endpoint = CompletionsEndpoint(services, 1 << 20, 30.0)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": ("127.0.0.1", 1),
             "headers": [(b"authorization", b"Bearer sk-x"), (b"content-length", b"2")]}  # fmt: skip
    asyncio.run(endpoint(scope, receive, send))
    assert sent[0]["status"] == 503
    error = orjson.loads(sent[1]["body"])["error"]
    assert error["code"] == "authentication_unavailable" and "secret" not in error["message"]


def test_hosted_stream_chunks_take_openai_shapes() -> None:
    """litellm's usage chunk has an empty choice, a last empty chunk follows, text may be missing."""
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert openai_chunk(role, True) == role
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert openai_chunk(finish, True) == finish
    assert openai_chunk({"choices": [{"index": 0, "delta": {}}], "usage": usage}, True) == {
        "choices": [],
        "usage": usage,
    }
    assert openai_chunk({"choices": [{"index": 0, "delta": {}}]}, True) is None  # carries nothing
    assert openai_chunk({"choices": [{"index": 0, "finish_reason": "length"}]}, False) == {
        "choices": [{"index": 0, "finish_reason": "length", "text": ""}]
    }
    assert openai_chunk({"choices": [{"index": 0}], "usage": usage}, False) == {"choices": [], "usage": usage}


def test_usage_past_what_max_tokens_allows_every_answer_is_not_believed() -> None:
    """A one-word answer billed as millions of tokens (under MAX_TOKENS) locked its key out."""
    usage = {"prompt_tokens": 5, "completion_tokens": 3_000_000, "total_tokens": 3_000_005}
    assert checked_usage(usage) is not None  # nothing to hold it against
    assert checked_usage(usage, {"max_tokens": 1}) is None
    fits = {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert checked_usage(fits, {"max_tokens": 4, "n": 2}) is not None  # 2 answers of 4
    assert checked_usage(fits, {"max_completion_tokens": 4, "prompt": ["a", "b"]}) is not None
    assert checked_usage(fits, {"max_tokens": 3, "n": 2}) is None
    assert checked_usage(fits, {}) is not None  # no max_tokens: the model's own cap applies
    # ... the one the request's reservation took (was: none, and an answer of five words was billed
    # as 10,000,000 tokens, $20,000 on a $100 budget)
    assert checked_usage(usage, {}, output_cap=4096) is None
    at_cap = {"prompt_tokens": 5, "completion_tokens": 2 * 4096, "total_tokens": 5 + 2 * 4096}
    assert checked_usage(at_cap, {"n": 2}, output_cap=4096) == at_cap
    assert checked_usage(at_cap, {"n": 2, "max_tokens": 10}, output_cap=4096) is None  # max_tokens first


BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "n": 3},
    {"messages": [{"role": "user", "content": "hi " * 500}], "max_completion_tokens": 40},
    {"prompt": ["a", "b", "c"], "max_tokens": 5, "n": 2},
    {"prompt": "one", "best_of": 4},
    {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "ab"}}],
    },
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("context", [None, 8192])
def test_usage_is_believed_up_to_the_requests_own_bounds_and_not_a_token_past_them(
    body: dict[str, Any], context: int | None
) -> None:
    """The prompt: its bytes once plus the templates' slack, whatever n; the answers: max_tokens
    each, else the output cap its reservation took (costs.output_cap: the chain's, the context's)."""
    prices = PriceBook(parse_policy(POLICY))
    size = len(orjson.dumps(body))
    cap = prices.output_cap(("fast",), (lambda m: context) if context else None)
    assert cap == (context or 4096)
    prompt = max_prompt(body, size)
    assert prompt == size + PROMPT_SLACK
    completion = (max_output(body) or cap) * choices(body)
    most = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    assert checked_usage(most, body, size, cap) == most
    total = prompt + completion + 1
    for more in ({**most, "prompt_tokens": prompt + 1, "total_tokens": total},
                 {**most, "completion_tokens": completion + 1, "total_tokens": total}):  # fmt: skip
        assert checked_usage(more, body, size, cap) is None


def test_reservations_cover_the_larger_of_max_tokens_and_max_completion_tokens() -> None:
    prices = PriceBook(parse_policy(POLICY))
    prompt = 400 * Decimal(1) / 10**6
    # our engine's legacy completions read only max_tokens; its chat reads max_completion_tokens first
    both = {"max_completion_tokens": 1, "max_tokens": 4000}
    assert prices.worst_case(("fast",), both, 400) == prompt + 4000 * Decimal(2) / 10**6
    swapped = {"max_completion_tokens": 4000, "max_tokens": 1}
    assert prices.worst_case(("fast",), swapped, 400) == prompt + 4000 * Decimal(2) / 10**6
    # an answer as long as the larger limit is believed, not recounted as if it broke the request's limit
    usage = {"prompt_tokens": 5, "completion_tokens": 4000, "total_tokens": 4005}
    assert checked_usage(usage, both, 400) == usage
    Admission._limits(_runtime(), _key(None, tpm=10**9), both, 400, ticket := Ticket())
    assert ticket.reserved_tokens == 100 + 4000


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("invalid key presented: Bearer sk-engine-123456789", "invalid key presented: [hidden]"),
        ("bad token=abc12345 here", "bad token=[hidden] here"),
        ('api_key: "zzzz9999"', 'api_key: "[hidden]"'),
        ("password=hunter2222", "password=[hidden]"),
        ("Bearer abcdefghijklmnopqrstu", "[hidden]"),
        # words, not credentials: kept (was: "Only [hidden] are supported", "Missing [hidden] ...")
        ("Only basic types are supported", "Only basic types are supported"),
        ("Missing bearer token in the header", "Missing bearer token in the header"),
        ("token: must be a string", "token: must be a string"),
        ("max_tokens must be at most 4096", "max_tokens must be at most 4096"),
    ],
)
def test_what_reads_as_a_credential_in_an_upstreams_message_is_masked_and_words_are_not(
    text: str, shown: str
) -> None:
    error = reduced_fields({"message": text, "type": "invalid_request_error"}, 400, "m")
    assert error["message"] == shown
    assert reduced_fields({"message": f"key {text} pool-key-abc"}, 400, "m", ("pool-key-abc",))[
        "message"
    ].endswith("[hidden]")  # the pool's own key, however it is spelled


def test_only_a_known_output_cap_bounds_what_a_usage_may_say() -> None:
    """The reservation takes 4,096 tokens for a chain whose caps are unknown (a model litellm's map
    lacks, an engine whose context is not known yet); a longer answer from it is real: held to that
    guess, a 9,000-token answer was billed as 4,096."""
    prices = PriceBook(parse_policy(POLICY))
    assert prices.output_cap(("fast",)) == 4096  # the reservation's guess
    assert prices.output_cap(("fast",), default=None) is None  # the usage bound: none known
    assert prices.output_cap(("fast",), lambda m: 8192, default=None) == 8192
    long = {"prompt_tokens": 5, "completion_tokens": 9000, "total_tokens": 9005}
    assert checked_usage(long, {}, 100, prices.output_cap(("fast",), default=None)) == long
