"""OpenAI response shapes: JSON and SSE encoding, usage, logprobs, errors for aborted requests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.http.protocol import APIError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Logprob
from engine.token_bytes import escaped

_MIN_LOGPROB = -9999.0  # JSON has no -inf

# A slow reader gets many tokens at once; they go out as several events of at most this much, so
# no SSE line grows without bound (clients cap lines: aiohttp, under the gateway, at 512 KiB).
# Worst case per event: 8192 characters escaped to 6 bytes each, plus 16 tokens x 21 logprob
# entries of a long token: well under 256 KiB.
MAX_EVENT_TOKENS = 16
MAX_EVENT_CHARS = 8192


def dumps(obj: Any) -> bytes:
    """Compact JSON, UTF-8, non-ASCII kept as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

# `stream_token_ids`: at most this many ids per comment line (a long line would hit clients' caps)
_IDS_PER_LINE = 4096


def prompt_tokens_line(count: int) -> bytes:
    """The SSE comment line (`: prompt_tokens <count>`) a stream opens with under `stream_prompt_tokens`:
    the prompt's tokens as the model read them (chat template, system prompt and all), which only the
    engine knows; the gateway reads and strips it, and bills it when the stream ends without usage."""
    return b": prompt_tokens %d\n\n" % count


def token_ids_lines(index: int, token_ids: list[int]) -> list[bytes]:
    """SSE comment lines (`: token_ids <choice> <id>,<id>...`) with a delta's token ids.

    A comment, which SSE clients ignore: only the gateway reads them (for stream resumption), and
    strips them. They go just before the data line that completes their delta.
    """
    return [
        b": token_ids %d %s\n\n" % (index, ",".join(map(str, token_ids[i : i + _IDS_PER_LINE])).encode())
        for i in range(0, len(token_ids), _IDS_PER_LINE)
    ]


def marked(events: list[bytes], index: int, pending: list[int]) -> list[bytes]:
    """A delta's events with the token ids not reported yet (`pending`, emptied) before the last one;
    without events the ids wait in `pending` for the next delta that sends something."""
    if not events or not pending:
        return events
    lines = token_ids_lines(index, pending)
    pending.clear()
    return [*events[:-1], *lines, events[-1]]


def event_pieces(text: str, num_tokens: int) -> list[tuple[str, int, int]]:
    """A delta of `text` and `num_tokens` tokens cut into events: (text piece, first token, end token).

    Empty when there is nothing to send. Token ranges index the delta's tokens (for logprobs).
    """
    count = max(-(-len(text) // MAX_EVENT_CHARS), -(-num_tokens // MAX_EVENT_TOKENS))
    return [
        (
            text[i * MAX_EVENT_CHARS : (i + 1) * MAX_EVENT_CHARS],
            min(i * MAX_EVENT_TOKENS, num_tokens),
            min((i + 1) * MAX_EVENT_TOKENS, num_tokens),
        )
        for i in range(count)
    ]


def text_pieces(text: str) -> list[str]:
    """`text` in pieces of at most MAX_EVENT_CHARS (at least one piece)."""
    return [text[i : i + MAX_EVENT_CHARS] for i in range(0, len(text), MAX_EVENT_CHARS)] or [text]


def slice_completion_logprobs(logprobs: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """Tokens [start:end) of legacy completions logprobs (every list is per token)."""
    return {key: values[start:end] for key, values in logprobs.items()}


def error_event(error: APIError) -> bytes:
    """The SSE event that ends a stream with an error, in OpenAI's error format."""
    return sse(error.body())


@dataclass
class ResponseIdentity:
    """What every response (and every chunk) of one API call repeats: its id, time, model, object."""

    id: str
    created: int
    model: str
    object: str


def response_head(identity: ResponseIdentity) -> dict[str, Any]:
    return {
        "id": identity.id,
        "object": identity.object,
        "created": identity.created,
        "model": identity.model,
    }


def text_choice(
    index: int, text: str, logprobs: Any, finish: str | None, stop_reason: int | str | None = None
) -> dict[str, Any]:
    """A completion choice (a stream's piece); the last says which stop ended it, as vLLM's does."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return choice


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """Usage from each request's last output (its totals are cumulative)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(o.num_generated_tokens for o in finals)
    cached = sum(o.num_cached_tokens for o in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def raise_if_aborted(final: RequestOutput) -> None:
    if any(c.finish_reason == "abort" for c in final.outputs):
        raise APIError(
            503, "the request was aborted: the server is shutting down", "server_error", code="aborted"
        )


def aborted_event() -> bytes:
    return sse(
        APIError(
            503, "the request was aborted: the server is shutting down", "server_error", code="aborted"
        ).body()
    )


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted((item for item in entry.items() if item[1].rank <= k), key=lambda item: item[1].rank)
    return ranked[:k]


def chat_logprobs(c: CompletionOutput, k: int | None) -> dict[str, Any]:
    """OpenAI chat logprobs for the tokens of a completion's delta."""
    content = []
    for token, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        chosen = entry[token]
        content.append(
            {**_chat_token(chosen), "top_logprobs": [_chat_token(lp) for _, lp in _top(entry, k or 0)]}
        )
    return {"content": content}


def _chat_token(lp: Logprob) -> dict[str, Any]:
    """A token as OpenAI's chat logprobs write it: its text (escaped bytes where it is part of a
    character), its logprob and its own bytes."""
    raw = lp.decoded_bytes
    if raw is None:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode())}
    return {"token": escaped(raw), "logprob": _lp(lp.logprob), "bytes": list(raw)}


def _legacy_token(lp: Logprob) -> str:
    """A token as legacy completions write it: `bytes:\\xf0\\x9f` where it is part of a character."""
    return (lp.decoded_token or "") if lp.decoded_bytes is None else "bytes:" + escaped(lp.decoded_bytes)


def logprobs_text_length(c: CompletionOutput) -> int:
    """Characters of a delta's tokens as `completion_logprobs` counts them for `text_offset`."""
    return sum(
        len(entry[token].decoded_token or "")
        for token, entry in zip(c.token_ids, c.logprobs or [], strict=False)
    )


def completion_logprobs(c: CompletionOutput, offset: int, k: int | None) -> dict[str, Any]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) of a delta.

    `offset`: where the delta's text starts in the choice's text.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        chosen = entry[token]
        tokens.append(_legacy_token(chosen))
        token_logprobs.append(_lp(chosen.logprob))
        # the k most likely, and the sampled token as well (up to k + 1, as OpenAI and vLLM send)
        top = {_legacy_token(lp): _lp(lp.logprob) for _, lp in _top(entry, k or 0)}
        top.setdefault(_legacy_token(chosen), _lp(chosen.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
