"""LLM: the offline, batch-at-once front of the engine (vLLM's `LLM.generate`)."""

from __future__ import annotations

import itertools
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

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for folders without one)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: OfflinePrompt | Seq[OfflinePrompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
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
        ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, params in zip(ids, prompt_list, params_list, strict=True):
                self.engine.add_request(request_id, prompt, params)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

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
        conversations = cast(
            list[list[dict[str, str]]], [messages] if messages and isinstance(messages[0], dict) else messages
        )
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
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, Seq) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    if all(isinstance(p, int) for p in prompts):
        return [cast(list[int], list(prompts))]
    return [_one_prompt(p) for p in prompts]


def _one_prompt(prompt: object) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs a 'prompt' string or 'prompt_token_ids'")
    if isinstance(prompt, Seq):
        return list(cast(list[int], prompt))
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
