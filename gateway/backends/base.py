"""What every upstream backend offers the proxy, and the errors it may raise."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.config.policy import Capabilities, Timeouts

UNREPORTED = Capabilities()  # a backend that says nothing about a capability
MAX_REPLY_BYTES = 64 << 20  # a whole upstream answer (an engine's or a provider's): past it, a fault
# an engine's comment line opening a stream (`stream_prompt_tokens`): the prompt's token count as
# the model read it (chat template, default system prompt), which only the engine knows
PROMPT_TOKENS = ": prompt_tokens "


class UpstreamUnavailableError(Exception):
    """The upstream could not be reached or did not answer in time (`deployment`: which one)."""

    def __init__(self, message: str, timeout: bool, deployment: str | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.deployment = deployment


class ModelUnavailableError(Exception):
    """The backend cannot be called at all (e.g. a hosted model whose API key is not configured)."""


class UpstreamStreamError(Exception):
    """A stream broke off after it had started."""


class UpstreamErrorEvent(UpstreamStreamError):
    """An engine ended its stream with an error event (a resumable stream's: it may go on elsewhere)."""


class UpstreamRequestErrorEvent(UpstreamStreamError):
    """An engine ended its stream with an `invalid_request_error` event: the request's own fault
    (a grammar that outgrew the parser's limits mid-answer), which another replica would meet
    again. Never resumed; `event` is what the client gets (the error's four fields, bounded)."""

    def __init__(self, event: bytes, code: str) -> None:
        super().__init__("the engine refused the request mid-stream")
        self.event = event
        self.code = code


@dataclass
class UpstreamReply:
    """A whole (non-streamed) upstream response."""

    status: int
    body: bytes
    url: str
    retry_after: int | None = None  # a 429's wait, sanitized (upstream_errors.retry_after_seconds)
    answer: dict[str, Any] | None = None  # a 200's body, parsed once it was found well formed
    hidden: tuple[str, ...] = ()  # what its error text must never show a client (UpstreamStream's)


def answer_object(body: bytes) -> dict[str, Any] | None:
    """A whole answer's JSON as a client's SDK reads it, or None when it is not one: an object whose
    `choices` is a non-empty list of objects, each with a `message` object (its `content`, if any, a
    string or null; its `tool_calls`, if any, a list) or a `text` string. A 200 of another shape
    (`{}`, `choices: "nope"`, `content: 12345`) was relayed and billed, and the SDK handed the
    application `choices=None` or raised later."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    for choice in choices:  # a loop, not all(generator): once per whole answer
        if not isinstance(choice, dict):
            return None
        message = choice.get("message")
        if message is None:
            if not isinstance(choice.get("text"), str):
                return None
        elif not _message_shaped(message):
            return None
    return answer


def _message_shaped(message: object) -> bool:
    """Whether a choice's `message` is an object whose content is text or null, its calls a list."""
    return (
        isinstance(message, dict)
        and isinstance(message.get("content"), str | None)
        and isinstance(message.get("tool_calls"), list | None)
    )


# An open stream's lines fed to `take` as they arrive, from the connection's own callbacks (no task
# woken per upstream write), until `take` declines one (returned: the caller handles it) or the
# stream ends (None). An error of the stream, or one `take` raises, is raised as `lines` raises it.
Pump = Callable[[Callable[[str], bool]], Awaitable[str | None]]


def _no_answer() -> None:
    """Default `answered` hook: nothing to tell."""


def _no_verdict(ok: bool) -> None:
    """Default stream verdict hook: nothing tracks this upstream's health."""


@dataclass
class UpstreamStream:
    """A streamed upstream response: SSE lines when status is 200, else an error body.

    `verdict(ok)` tells the backend's health accounting how the stream went when the caller is the
    one who knows (e.g. it gave up waiting for the first event); the first verdict counts.
    """

    status: int
    lines: AsyncIterator[str]
    error_body: bytes
    url: str
    verdict: Callable[[bool], None] = field(default=_no_verdict)
    retry_after: int | None = None  # as UpstreamReply's
    pump: Pump | None = None  # `lines` fed to a callback as they arrive (an engine replica's)
    hidden: tuple[str, ...] = ()  # what the upstream's error text must never show a client (our key)
    # the answer is whole: a break after it (while what follows [DONE] is drained) is not the
    # upstream's failure
    answered: Callable[[], None] = field(default=_no_answer)


@dataclass(frozen=True)
class Learned:
    """What a backend says one of its models can do: each capability true, false or unsaid (None)."""

    capabilities: Capabilities = UNREPORTED
    context_length: int | None = None  # prompt tokens it takes at most


class Upstream(Protocol):
    """An engine pool or a hosted model."""

    name: str

    @property
    def learned_version(self) -> int:
        """Changes whenever what `learned` answers changes (a replica reported something new)."""
        ...

    def learned(self, model: str) -> Learned | None:
        """What the backend says about `model` (its upstream name), or None when it said nothing.
        Never I/O: the answer was learned beforehand (health checks, litellm's bundled map)."""
        ...

    @property
    def timeouts(self) -> Timeouts:
        """The backend's own timeouts (a route may replace them)."""
        ...

    @property
    def unavailable_reason(self) -> str | None:
        """Why the backend cannot be called, or None."""
        ...

    async def send(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> UpstreamReply:
        """One whole response (`avoid`: deployments this request already failed on; `headers`:
        extra request headers, the trace context when tracing is on; `affinity`: the request's
        prefix key, for pools that balance by it)."""
        ...

    def stream(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> AbstractAsyncContextManager[UpstreamStream]:
        """A streamed response; leaving the context releases the upstream."""
        ...

    async def start(self) -> None:
        """Begin background work (health checks), inside the running loop."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


LACKS = "lacks "  # outcome of a model skipped for a capability: `lacks tools, vision`
TOO_LONG = "prompt too long"  # ... for its context: `prompt too long (9100 tokens > 8192)`


@dataclass
class Attempt:
    """One try: which model, backend and deployment, and what happened."""

    model: str
    backend: str
    deployment: str | None
    outcome: str
    called: bool = True  # False: skipped before any call (unavailable, or it cannot serve the request)

    def describe(self) -> str:
        """Everything known, replica URL and error text included: for the request log, never a client."""
        where = f"{self.model}@{self.deployment}" if self.deployment else self.model
        return f"{where}={self.outcome}"

    def public(self) -> str:
        """What a client may see (x-gateway-failover, error messages): the model and a bounded reason."""
        return f"{self.model}={self.reason}"

    @property
    def reason(self) -> str:
        """The outcome as a bounded label (metrics, traces): unavailable, unreachable, timeout,
        first_token_timeout, stream_broke, status_<code>, lacks_<capability> (the first it lacks)
        or context_exceeded."""
        outcome = self.outcome
        if outcome.startswith("status "):
            return "status_" + outcome[7:]
        if outcome.startswith("unavailable"):
            return "unavailable"
        if outcome.startswith(LACKS):
            return "lacks_" + outcome[len(LACKS) :].split(",")[0]
        if outcome.startswith(TOO_LONG):
            return "context_exceeded"
        if outcome.startswith("stream broke"):
            return "stream_broke"
        return outcome.replace(" ", "_")
