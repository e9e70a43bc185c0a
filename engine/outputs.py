"""What the engine returns for a request: per-step deltas of its completions, and timing metrics.

Each step emits, per request that made progress, only what is new (vLLM's DELTA output kind): the
new token ids, the new text, the new logprobs and a finish reason once there is one. Cumulative
figures (prompt, token counts, cumulative logprob, metrics) ride along, so a reader needs no
history for usage. A reader that wants the whole output folds deltas with `add()`: the offline
`LLM.generate` does, and a request stream does it for a reader that falls behind.
"""

from __future__ import annotations

import bisect
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
    """One of the `n` completions of a request: in a delta, only its new tokens, text and logprobs.

    Text may lag tokens: a token ending inside a UTF-8 character, or text that may still become a
    stop string, shows up in a later delta (all of it by the one that finishes the completion).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per token of `token_ids`
    cumulative_logprob: float | None = None  # over every token so far, not just this delta's
    # a resumed completion's first delta: the text of the tokens it was resumed with, which the
    # reader already has (it rebuilds its stream state from it; never sent again)
    replayed_text: str = ""

    @property
    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later delta of the same completion (its finish reason, if any, wins)."""
        assert later.index == self.index
        self.text += later.text
        self.replayed_text += later.replayed_text
        self.token_ids.extend(later.token_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        if later.cumulative_logprob is not None:
            self.cumulative_logprob = later.cumulative_logprob


@dataclass
class RequestOutput:
    """What one step brought for a request: the completions that made progress, and its totals.

    `outputs` holds only completions with something new, in index order; the delta that finishes
    the request lists every completion (with its finish reason), so its reader sees how all ended.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_generated_tokens: int = 0  # over all completions and all steps so far

    def add(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one (a slow reader's coalescing)."""
        assert later.request_id == self.request_id
        indices = [c.index for c in self.outputs]
        for comp in later.outputs:
            pos = bisect.bisect_left(indices, comp.index)
            if pos < len(indices) and indices[pos] == comp.index:
                self.outputs[pos].add(comp)
            else:  # a completion new to this delta: a fresh copy, `later` stays untouched
                indices.insert(pos, comp.index)
                self.outputs.insert(pos, _copy(comp))
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_generated_tokens = later.num_generated_tokens

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


def _copy(comp: CompletionOutput) -> CompletionOutput:
    logprobs = list(comp.logprobs) if comp.logprobs is not None else None
    return CompletionOutput(
        comp.index,
        comp.text,
        list(comp.token_ids),
        comp.finish_reason,
        comp.stop_reason,
        logprobs,
        comp.cumulative_logprob,
    )
