"""InputProcessor: a prompt becomes an admitted request: tokenized, length-checked, its guided-
decoding constraint compiled, its sequences.

Kept out of LLMEngine so that the engine is add / step / abort. `prepare_prompt()` reads only what
loading fixed, so it is safe from any thread: the server runs it in a worker, and a long prompt
never holds up the step loop. The constraint compiles on the compiler's own thread
(`compiler()`): the server awaits it beside the tokenizing, the offline API waits for it
(`prepare()`); the step loop only ever gets compiled grammars. `sequences()` runs on the step-loop
thread (it numbers sequences and gives each its own grammar state).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ContextLengthExceededError, InvalidRequestError, KVCacheCapacityError
from engine.guided import CompiledGrammar, GuidedCompiler, GuidedDecodingError, GuidedSpec
from engine.models.config import ModelConfig
from engine.prompt_length import tokens_at_least
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, choice_seed

Prompt = str | list[int]


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt that passed admission checks: its text, token ids, the completion's token bound and
    its compiled constraint (None without one)."""

    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    grammar: CompiledGrammar | None = None
    # a resumed completion: the output tokens another replica already streamed (replayed, not sampled)
    resume_token_ids: tuple[int, ...] = ()
    # bad_words' token sequences (each word alone and after a space, as vLLM tokenizes them)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()


# a prompt to be cut to its last tokens (truncate_prompt_tokens) may be this many contexts long
TRUNCATE_SLACK = 4


class InputProcessor:
    """Tokenizes and checks prompts against the context and the KV pool; builds their sequences."""

    def __init__(
        self,
        tokenizer: Any,
        model_config: ModelConfig,
        max_model_len: int,
        num_token_slots: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> None:
        self.tokenizer = tokenizer  # None for folders without one: prompts are token ids
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.num_token_slots = num_token_slots  # tokens the whole KV pool holds
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._seq_ids = itertools.count()
        self._compiler: GuidedCompiler | None = None
        self._compiler_lock = threading.Lock()

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool = True,
        resume_token_ids: list[int] | None = None,
    ) -> PreparedPrompt:
        """`prepare_prompt`, then the constraint compiled (blocking: the offline API)."""
        prepared = self.prepare_prompt(prompt, params, add_special_tokens, resume_token_ids)
        if params.guided is None:
            return prepared
        return dataclasses.replace(prepared, grammar=self.compiler(params.guided).compile(params.guided))

    def prepare_prompt(
        self,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool = True,
        resume_token_ids: list[int] | None = None,
    ) -> PreparedPrompt:
        """Tokenize and check lengths; raises an InvalidRequestError subclass when it cannot run.

        `resume_token_ids`: the output so far of a completion to go on with (one sequence only).
        """
        truncate = params.truncate_prompt_tokens
        if truncate == -1:  # as many as the context holds beside the answer's tokens (at least one)
            truncate = max(1, self.max_model_len - (params.max_tokens or 1))
        if params.stop_strings and self.tokenizer is None:  # (they were never looked for)
            raise InvalidRequestError(
                "this model folder has no tokenizer, which stop strings need", param="stop"
            )
        prompt_text, prompt_ids = self._tokenize(prompt, add_special_tokens, truncate)
        max_tokens = self._check_lengths(len(prompt_ids), params)
        self._check_logit_bias(params)
        self._check_allowed_token_ids(params)
        self._check_stop_token_ids(params)
        resumed = () if resume_token_ids is None else self._check_resume(resume_token_ids, params, max_tokens)
        bad = self._bad_word_ids(params.bad_words) if params.bad_words else ()
        return PreparedPrompt(prompt_text, prompt_ids, max_tokens, resume_token_ids=resumed, bad_word_ids=bad)

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as it starts the text and as it follows a space (vLLM's way: the
        second only where the space makes other tokens of the same count)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model folder has no tokenizer, which bad_words needs", param="bad_words"
            )
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if alone:
                out.append(alone)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(dict.fromkeys(out))

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )

    def _check_allowed_token_ids(self, params: SamplingParams) -> None:
        allowed = params.allowed_token_ids
        if allowed is None:
            return
        vocab = self.vocab_size
        bad = next((t for t in allowed if not 0 <= t < vocab), None)
        if bad is not None:
            message = f"allowed_token_ids holds {bad}, outside the vocabulary [0, {vocab})"
            raise InvalidRequestError(message, param="allowed_token_ids")
        if params.guided is not None:  # the grammar's tokens and these may have nothing in common
            message = "allowed_token_ids cannot go with a structured output or tools"
            raise InvalidRequestError(message, param="allowed_token_ids")

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        """Ids inside the vocabulary; and `min_tokens` that some token can meet: with every token a
        stop (or the end of sequence), the masked row would have nothing left to sample."""
        vocab = self.vocab_size
        stops = set(params.stop_token_ids or ())
        bad = next((t for t in stops if not 0 <= t < vocab), None)
        if bad is not None:
            message = f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})"
            raise InvalidRequestError(message, param="stop_token_ids")
        ends = stops if params.ignore_eos else stops | {t for t in self.eos_token_ids if 0 <= t < vocab}
        if params.min_tokens and len(ends) >= vocab:
            raise InvalidRequestError(
                "min_tokens cannot be met: stop_token_ids and the end-of-sequence tokens cover the whole "
                "vocabulary", param="min_tokens"
            )  # fmt: skip
        allowed = params.allowed_token_ids
        if params.min_tokens and allowed is not None and set(allowed) <= ends:
            raise InvalidRequestError(
                "min_tokens cannot be met: every token allowed_token_ids allows ends the sequence",
                param="min_tokens",
            )

    def _check_resume(self, ids: list[int], params: SamplingParams, max_tokens: int) -> tuple[int, ...]:
        if params.n != 1:
            raise InvalidRequestError("only a request with n = 1 can be resumed", param="resume")
        if len(ids) > max_tokens:
            raise InvalidRequestError(
                f"resume has {len(ids)} tokens, more than the completion's {max_tokens}", param="resume"
            )
        vocab = self.vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"resume token id {bad!r} is outside the vocabulary [0, {vocab})", param="resume.token_ids"
            )
        return tuple(ids)

    def compiler(self, spec: GuidedSpec) -> GuidedCompiler:
        """The engine's one grammar compiler, made on first use: its view of the vocabulary takes
        ~0.6 s to build (49k tokens), which engines that never see a constraint should not pay.
        `spec` names the field to blame when the model has no tokenizer."""
        if self.tokenizer is None:
            raise GuidedDecodingError(
                "this model folder has no tokenizer, which guided decoding needs", param=spec.param
            )
        with self._compiler_lock:
            if self._compiler is None:
                # the grammar allows the model's EOS ids once complete (not a request's stop ids);
                # bitmask rows span the logits' width (ids past the tokenizer's are never allowed)
                self._compiler = GuidedCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._compiler

    def close(self) -> None:
        """Stop the compiler's thread, if one was started."""
        if self._compiler is not None:
            self._compiler.close()

    def sequences(
        self, request_id: str, prepared: PreparedPrompt, params: SamplingParams, arrival: float
    ) -> list[Sequence]:
        """The request's `n` sequences (step-loop thread only), each with its own grammar state."""
        assert (params.guided is None) == (prepared.grammar is None), "only compiled requests run"
        assert prepared.grammar is None or prepared.grammar.spec == params.guided
        return [self._new_sequence(request_id, i, prepared, params, arrival) for i in range(params.n)]

    def _tokenize(
        self, prompt: Prompt, add_special_tokens: bool, truncate: int | None = None
    ) -> tuple[str | None, list[int]]:
        """The prompt's text and ids; `truncate` (vLLM's truncate_prompt_tokens): only its last that
        many tokens, the text then unknown. A text surely longer than TRUNCATE_SLACK contexts is
        refused even so: one tokenizer call holds every other thread (the step loop's included)
        ~1 s a megabyte (engine/prompt_length.py)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model folder has no tokenizer: pass token ids")
            # a text surely over the context is refused before it is tokenized (one to be cut: over
            # TRUNCATE_SLACK contexts)
            bound = self.max_model_len * (TRUNCATE_SLACK if truncate else 1)
            at_least = tokens_at_least(self.tokenizer, prompt, bound)
            if at_least is not None:
                raise ContextLengthExceededError(
                    f"This model's maximum context length is {self.max_model_len} tokens, "
                    f"but the prompt has at least {at_least} tokens"
                )
            ids = list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if truncate and len(ids) > truncate:
            ids, text = ids[-truncate:], None
        if len(ids) >= self.max_model_len:
            return text, ids  # _check_lengths rejects it; no need to look at every id
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return text, ids

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        limit, capacity = self.max_model_len, self.num_token_slots
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, "
                f"but the prompt has {prompt_len} tokens"
                + (" (the completion needs at least one more)" if prompt_len == limit else "")
            )
        # the last token sampled is never fed back, so its KV is never stored: a request holds at
        # most prompt + max_tokens - 1 slots
        if prompt_len > capacity:
            raise KVCacheCapacityError(
                f"the prompt needs {prompt_len} tokens of KV cache but the whole pool holds "
                f"{capacity}: shorten the prompt or give the engine more kv_cache_memory",
                param="prompt",
            )
        if params.max_tokens is None:  # as much as fits, in the context and in the whole KV pool
            return min(limit - prompt_len, capacity + 1 - prompt_len)
        max_tokens = params.max_tokens
        if prompt_len + max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion)",
                param="max_tokens",
            )
        if prompt_len + max_tokens - 1 > capacity:
            raise KVCacheCapacityError(
                f"the request needs up to {prompt_len + max_tokens - 1} tokens of KV cache "
                f"({prompt_len} in the prompt, {max_tokens - 1} for the completion) but the whole pool "
                f"holds {capacity}: lower max_tokens or give the engine more kv_cache_memory",
                param="max_tokens",
            )
        return max_tokens

    def _new_sequence(
        self, request_id: str, index: int, prepared: PreparedPrompt, params: SamplingParams, arrival: float
    ) -> Sequence:
        generator, seed = None, None
        if params.seed is not None:  # reseeded at every output position (Sequence.seeded_generator)
            generator = torch.Generator(device=self.device)
            seed = choice_seed(params.seed, index)
        prompt_ids = prepared.prompt_token_ids
        detok = None
        if self.tokenizer is not None:
            tok, skip = self.tokenizer, params.skip_special_tokens
            detok = IncrementalDetokenizer(
                lambda ids: tok.decode(ids, skip_special_tokens=skip), prompt_ids, params.stop_strings,
                params.include_stop_str_in_output,
            )  # fmt: skip
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            index,
            prompt_ids,
            params,
            prepared.max_tokens,
            self.eos_token_ids,
            detok,
            generator,
            arrival,
            None if prepared.grammar is None else prepared.grammar.matcher(),
            seed,
        )
        seq.bad_word_ids = prepared.bad_word_ids
        return seq
