"""LLM: the offline, batch-at-once front of the engine (vLLM's `LLM.generate`)."""

from __future__ import annotations

import itertools
import numbers
import operator
import threading
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm import tqdm

from engine.config import EngineConfig
from engine.input_processor import Prompt
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Load a model once, then `generate` for many prompts with continuous batching."""

    def __init__(self, model: str = "default", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self._ids = itertools.count()
        # one call at a time: two threads stepping the engine at once took each other's outputs and
        # left it broken for good (a second thread's call waits for the first's)
        self._lock = threading.Lock()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for folders without one)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: OfflinePrompt | Seq[OfflinePrompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. The sampling params are
        read as they are now (vLLM reads them when the requests are added). A call that ends early
        (an error, Ctrl-C) aborts its requests: none is left for the next call to run first."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts: "
                    "pass one for all or one per prompt"
                )
        checked = {id(p): p.checked() for p in params_list}  # each object's own copy, as it is now
        with self._lock:
            ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
            try:
                for request_id, prompt, params in zip(ids, prompt_list, params_list, strict=True):
                    self.engine.add_request(request_id, prompt, checked[id(params)])
                return self._run(ids, use_tqdm)
            except BaseException:  # (KeyboardInterrupt too: the requests would run in the next call)
                for request_id in ids:
                    self.engine.abort_request(request_id)
                raise

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so no chat template")
        conversations = [
            _plain_messages(c)
            for c in cast(list[Any], [messages] if messages and isinstance(messages[0], dict) else messages)
        ]
        prompts: list[Prompt] = [
            list(
                tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        # the engine's deltas, folded per request into whole outputs
        whole: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                deltas = self.engine.step()
                if self.engine.failed:  # a request failed on its own: the call fails with its error
                    for request_id in self.engine.unfinished_request_ids():
                        self.engine.abort_request(request_id)
                    raise next(iter(self.engine.failed.values()))
                for delta in deltas:
                    out = whole.setdefault(delta.request_id, delta)
                    if out is not delta:
                        out.add(delta)
                    if delta.finished:
                        out_tokens += delta.num_generated_tokens
                        bar.update(1)
                        bar.set_postfix(out_tok=out_tokens, refresh=False)
        finally:
            bar.close()
        return [whole[i] for i in ids]


OfflinePrompt = Prompt | dict[str, Any]  # also vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}


def _normalize_prompts(prompts: OfflinePrompt | Seq[OfflinePrompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict, bytes, bytearray)):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, Seq) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    if all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in prompts):
        return [_token_ids(prompts)]
    return [_one_prompt(p) for p in prompts]


def _one_prompt(prompt: object) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        other = set(prompt) - {"prompt", "prompt_token_ids"}
        if other:  # (multi_modal_data was dropped silently: the answer was the text's alone)
            raise ValueError(f"a dict prompt takes 'prompt' or 'prompt_token_ids' only, not {sorted(other)}")
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs a 'prompt' string or 'prompt_token_ids'")
    if isinstance(prompt, Seq) and not isinstance(prompt, bytes | bytearray):  # (b"hi" was ids 104, 105)
        return _token_ids(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


def _token_ids(ids: Any) -> list[int]:
    """Token ids as Python ints (numpy's and torch's integers included); anything else a ValueError."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers") from None


def _plain_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation for the chat template: OpenAI's content parts joined as vLLM joins them (the
    text parts, a newline between); a part of another kind is a ValueError naming it."""
    plain = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = [
                p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content
            ]
            if any(not isinstance(t, str) for t in texts):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            message = {**message, "content": "\n".join(cast(list[str], texts))}
        plain.append(message)
    return plain
