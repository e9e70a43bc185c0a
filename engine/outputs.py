"""What the engine returns for a request: completions, logprobs and timing metrics."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Logprob


@dataclass
class RequestMetrics:
    """Timing (monotonic seconds) and cache figures of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds spent waiting before the first step that ran the request."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: prompt, its completions so far, and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (as in vLLM's RequestOutput)."""
        return self.metrics.num_cached_tokens

    @property
    def token_ids(self) -> list[int]:
        """Tokens of the first completion."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        """Text of the first completion."""
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        """Finish reason of the first completion."""
        return self.outputs[0].finish_reason
