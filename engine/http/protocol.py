"""OpenAI request schemas (the subset the engine serves) and OpenAI-format errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import EngineError
from engine.guided import GuidedDecodingError, GuidedSpec, from_response_format, from_structured_outputs
from engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.tools.grammar import tool_spec
from engine.tools.request import ToolRequest, parse_tool_request


class APIError(EngineError):
    """An error answered in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Errors whose text is fixed: the client learns what happened, never an internal detail (that goes
# to the server log).
INTERNAL_ERROR = APIError(500, "Internal server error", "server_error", code="internal_error")


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` changes anything."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False
    # vLLM's usage on every chunk: not served, so refused rather than ignored (false passes)
    continuous_usage_stats: bool | None = False

    @model_validator(mode="after")
    def _no_continuous_usage(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise ValueError(
                "stream_options.continuous_usage_stats: usage on every chunk is not supported by this server"
            )
        return self


# A resumed completion's tokens so far: bounded here, then by the model's context at admission.
MAX_RESUME_TOKENS = 1 << 20


class ResumeRequest(BaseModel):
    """`resume` (ours): go on with a streamed completion another replica began, from the token ids
    it streamed (`stream_token_ids`); the gateway's stream resumption sends it (docs/engine.md).

    `id` and `created` keep the first replica's response identity on the resumed chunks.
    """

    model_config = ConfigDict(strict=True, extra="forbid")
    token_ids: list[int] = Field(max_length=MAX_RESUME_TOKENS)
    id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    created: int | None = Field(None, ge=0, lt=2**40)


@dataclass(frozen=True)
class TemplateOptions:
    """vLLM's chat-template switches: `generation_prompt` opens the assistant's turn after the
    messages (the default); `continue_final` leaves the last (assistant) message open instead, for the
    model to go on with it (a "prefilled" answer)."""

    generation_prompt: bool = True
    continue_final: bool = False


OPEN_TURN = TemplateOptions()


# vLLM's chat-template switches: a chat request's own fields; on a text completion, unsupported
_TEMPLATE_SWITCHES = ("continue_final_message", "add_generation_prompt")
# vLLM request extensions that would change the answer, each with the values that change nothing
_UNSUPPORTED_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,),
    "logits_processors": (None, []),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "use_beam_search": (None, False),
}
# ... and those of a chat only (a text completion's `echo` is served)
_UNSUPPORTED_CHAT_EXTENSIONS: dict[str, tuple[Any, ...]] = {"echo": (None, False)}


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extensions)."""

    # NaN and infinities (Python's JSON reader takes them) are refused as such, not as out of range
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: Any = None  # string or list of strings, checked by `stop_strings()`
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # token id (as JSON keys are: decimal text) -> bias in [-100, 100], at most MAX_LOGIT_BIAS
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    include_stop_str_in_output: bool | None = False  # vLLM's: the stop string that ended it stays
    # vLLM's: only the prompt's last that many tokens are read (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: words never completed
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS
    )
    # vLLM's: only these tokens may be sampled (ids within the vocabulary, checked with the prompt)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = True
    speculative: bool | None = True  # ours: false opts the request out of speculative decoding
    # ours, for the gateway's stream resumption: each streamed delta's token ids as an SSE comment
    # line, and a completion resumed from another replica's tokens
    stream_token_ids: bool | None = False
    resume: ResumeRequest | None = None
    # ours, for the gateway's request log: a stream opens with its prompt's token count (after the
    # chat template) in an SSE comment line, so that one the client leaves is billed what it read
    stream_prompt_tokens: bool | None = False
    # guided decoding: OpenAI's response_format, vLLM's structured_outputs (checked by guided_spec())
    response_format: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_extensions(cls, data: Any) -> Any:
        # vLLM's extensions that change the answer, not implemented here: ignored like other unknown
        # fields, the client would get an answer that silently disregards them; their neutral values
        # (absent, null, false, an empty list) pass, as a client that always sends them does
        if isinstance(data, Mapping):
            chat = "messages" in cls.model_fields
            refused = {**_UNSUPPORTED_EXTENSIONS, **(_UNSUPPORTED_CHAT_EXTENSIONS if chat else {})}
            for key, neutral in refused.items():
                if key in _TEMPLATE_SWITCHES and chat:  # a chat's, read there
                    continue
                if key in data and data[key] not in neutral:
                    raise ValueError(f"{key}: {key} is not supported by this server")
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_removed_guided_fields(cls, data: Any) -> Any:
        # vLLM 0.12 removed these; ignored like other unknown fields, a constraint would be dropped
        # silently and the answer would not be held to it
        if isinstance(data, Mapping):
            for key in data:
                if isinstance(key, str) and key.startswith("guided_"):
                    raise ValueError(
                        f"{key}: {key} was removed (as in vLLM 0.12): use structured_outputs "
                        "(json, regex, choice, grammar, json_object, whitespace_pattern)"
                    )
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.resume is not None and not self.stream:
            raise ValueError("resume: only a stream can be resumed (stream must be true)")
        if self.resume is not None and (self.n or 1) != 1:
            raise ValueError("resume: only a request with n = 1 can be resumed")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def guided_spec(self) -> GuidedSpec | None:
        """The output constraint (None: free text); a malformed one is a 400 naming its field."""
        spec = from_response_format(self.response_format)
        if self.structured_outputs is None:
            return spec
        if spec is not None:
            raise GuidedDecodingError(
                "give response_format or structured_outputs, not both",
                code="invalid_value",
                param="structured_outputs",
            )
        return from_structured_outputs(self.structured_outputs)

    def stop_strings(self) -> list[str]:
        """`stop` as a list, with a clear error for anything but strings."""
        stop = self.stop
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(
                400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type"
            )
        if any(not s for s in stop):
            raise APIError(400, "'stop' strings must not be empty", param="stop", code="invalid_value")
        return stop


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # tool calling (checked by tool_request()); functions / function_call: the legacy spelling
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    # vLLM's chat-template switches (checked by template_options())
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False

    def template_options(self) -> TemplateOptions:
        """How the conversation goes through the chat template: the assistant's turn opened after it
        (the default), the last message left open for the model to go on with
        (`continue_final_message`, an assistant message), or neither (`add_generation_prompt: false`)."""
        if not self.continue_final_message:
            return TemplateOptions(self.add_generation_prompt is not False, False)
        if self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="add_generation_prompt")  # fmt: skip
        last = self.messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")  # fmt: skip
        return TemplateOptions(False, True)

    def tool_request(self) -> ToolRequest | None:
        """The tools offered and how they may be used (None: no tools); a malformed field is a 400."""
        fields = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
        return parse_tool_request({f: getattr(self, f) for f in fields if getattr(self, f) is not None})

    def guided_spec(self) -> GuidedSpec | None:
        """The output constraint: response_format / structured_outputs, or the tool-call grammar."""
        spec = super().guided_spec()
        tools = self.tool_request()
        if tools is None or not tools.calls_allowed:
            return spec
        if spec is None:
            return tool_spec(tools)
        if spec.kind not in ("json_schema", "json_object"):
            raise GuidedDecodingError(
                "with tools, the output can only be held to a JSON response_format (json_schema or "
                f"json_object), not a {spec.kind.replace('_', ' ')}",
                code="invalid_value",
                param="response_format" if self.response_format is not None else "structured_outputs",
            )
        # auto: the answer in that format, or calls; required or named: calls only (no text to hold)
        return tool_spec(tools) if tools.calls_only else tool_spec(tools, spec)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Any  # string, array of strings, array of token ids, array of arrays: see `prompts()`
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported_combinations(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: this model does not support inserting text (suffix)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: echo together with logprobs (prompt logprobs) is not supported")
        return self


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as an OpenAI 400, naming the parameter."""
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    loc = [str(p) for p in err["loc"]]
    msg = str(err["msg"])
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {msg}", code="invalid_json")
    if kind == "model_type" and not loc:
        return APIError(400, "The request body must be a JSON object", code="invalid_type")
    if kind == "value_error":  # a model validator: "param: message"
        text = msg.removeprefix("Value error, ")
        name, _, detail = text.partition(": ")
        return APIError(400, detail or text, param=name or None, code="invalid_value")
    # ("messages", 0, "role") -> messages[0].role, as the fields checked by hand are named
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or None
    if kind == "missing":
        return APIError(
            400, f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter"
        )
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized parameter: '{param}'", param=param, code="unknown_parameter")
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    what = "type" if code == "invalid_type" else "value"
    return APIError(400, f"Invalid {what} for '{param}': {msg}", param=param, code=code)


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """`logit_bias`'s keys as token ids (the vocabulary is checked when the prompt is prepared)."""
    if not given:
        return None
    bias: dict[int, float] = {}
    for key, value in given.items():
        if not key.isascii() or not key.isdigit() or len(key) > 12:
            raise APIError(400, f"logit_bias: {key[:40]!r} is not a token id", param="logit_bias",
                           code="invalid_value")  # fmt: skip
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}",
                           param="logit_bias", code="invalid_value")  # fmt: skip
        bias[int(key)] = value
    return bias


def build_sampling_params(
    req: _SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, float],
    guided: GuidedSpec | None = None,
) -> SamplingParams:
    """Request fields first, then the model's defaults, then OpenAI's; `guided`: req.guided_spec()."""

    def pick(value: float | None, name: str, fallback: float) -> float:
        return value if value is not None else defaults.get(name, fallback)

    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens must be at most max_tokens ({max_tokens}), got {req.min_tokens}",
                       param="min_tokens", code="invalid_value")  # fmt: skip
    if any(token < 0 for token in req.stop_token_ids or []):
        raise APIError(400, "stop_token_ids must be non-negative token ids", param="stop_token_ids",
                       code="invalid_value")  # fmt: skip

    temperature = pick(req.temperature, "temperature", 1.0)
    top_p = pick(req.top_p, "top_p", 1.0)
    if top_p == 0.0:  # only the most likely token survives: that is greedy decoding
        temperature, top_p = 0.0, 1.0
    try:
        return SamplingParams(
            n=req.n or 1,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=int(pick(req.top_k, "top_k", 0)),
            min_p=pick(req.min_p, "min_p", 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            seed=req.seed,
            stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            min_tokens=req.min_tokens or 0,
            skip_special_tokens=req.skip_special_tokens is not False,
            guided=guided,
            speculative=req.speculative is not False,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            bad_words=req.bad_words or None,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
