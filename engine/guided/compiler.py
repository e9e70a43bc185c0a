"""GuidedCompiler: GuidedSpecs -> compiled grammars for one tokenizer, beside the step loop.

The library is llguidance (docs/engine.md, "Guided decoding: library choice"). Compiles run on a
small thread pool of their own and llguidance drops the GIL while it builds a grammar, so neither
the asyncio loop nor the step loop waits on one (measured: a 40-object schema compiles in 25 ms on
a thread; the caller's ~20 us steps beside it took 0.7 ms at worst). Results sit in an LRU bounded
in entries and keyed by the spec, failures included: a spec fails the same way every time, so a
client that resends a bad schema costs nothing. Concurrent requests for one spec share one compile
(the cache holds futures). A spec the library refuses raises GuidedDecodingError (400) with its
reason.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, StructTag
from llguidance.gbnf_to_lark import any_to_lark

from engine.guided.bitmask import bitmask_width
from engine.guided.errors import GuidedDecodingError, library_refusal
from engine.guided.matcher import CompiledGrammar
from engine.guided.spec import BOUNDED_WHITESPACE, GuidedSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only


class GuidedCompiler:
    """Compiles specs for one tokenizer off the caller's thread; `compile` waits, `compile_async` awaits."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_entries: int = 256,
        workers: int = 1,
    ) -> None:
        """tokenizer: a fast HF tokenizer or an llguidance LLTokenizer; vocab_size: the model's logits
        width (ids past the tokenizer's are never allowed); stop_token_ids: what the grammar allows
        once complete (the model's EOS ids)."""
        assert max_entries >= 1 and workers >= 1 and stop_token_ids
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="guided-compile")
        # llguidance's token trie takes ~2 s to build for a 49k vocabulary: on the pool, not here
        self._tokenizer = self._pool.submit(_lltokenizer, tokenizer, vocab_size, list(stop_token_ids))
        self._cache: OrderedDict[GuidedSpec, Future[CompiledGrammar]] = OrderedDict()
        # requests waiting on each unfinished compile: one that all have left before it started is
        # cancelled (clients that send heavy schemas and hang up leave no queue behind them)
        self._waiters: dict[Future[CompiledGrammar], int] = {}
        self._lock = threading.Lock()
        self._limits = LLParserLimits(verbose_errors=False)

    def submit(self, spec: GuidedSpec, *, waiting: bool = False) -> Future[CompiledGrammar]:
        """The compile of `spec`: a cached future, or a new one queued on the pool. waiting: the
        caller counts as a waiter until it calls `_leave` (compile, compile_async)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
            else:
                future = self._pool.submit(self._compile, spec)
                self._cache[spec] = future
                self.misses += 1
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)  # waiters hold their own reference
            if waiting and not future.done():
                self._waiters[future] = self._waiters.get(future, 0) + 1
            return future

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Blocking compile (the offline API)."""
        future = self.submit(spec, waiting=True)
        try:
            return _result(future, spec)
        finally:
            self._leave(spec, future)

    async def compile_async(self, spec: GuidedSpec) -> CompiledGrammar:
        """Awaitable compile. A caller cancelled while others wait leaves the shared compile to
        them; the last one to leave a compile that has not started cancels it."""
        future = self.submit(spec, waiting=True)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except GuidedDecodingError as exc:
            raise _for_request(exc, spec) from exc
        finally:
            self._leave(spec, future)

    def _leave(self, spec: GuidedSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            left = self._waiters.get(future, 0) - 1
            if left > 0:
                self._waiters[future] = left
                return
            self._waiters.pop(future, None)
            if future.cancel() and self._cache.get(spec) is future:  # still queued: never runs
                del self._cache[spec]

    def cached(self, spec: GuidedSpec) -> bool:
        """Whether `spec` has a finished compile in the cache (the step loop may use it at once)."""
        with self._lock:
            future = self._cache.get(spec)
        return future is not None and future.done()

    def close(self) -> None:
        """Stop the pool; queued compiles are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GuidedSpec) -> CompiledGrammar:
        tokenizer = self._tokenizer.result()
        try:
            grammar = _grammar(spec, tokenizer)
        except GuidedDecodingError:  # refused with its reason already (a GBNF grammar it cannot read)
            raise
        except (ValueError, RecursionError) as exc:  # llguidance's converters raise plain errors
            raise _refusal(spec, str(exc) or type(exc).__name__) from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        error = matcher.get_error() if matcher.is_error() else _first_step_error(matcher, self.vocab_size)
        if error is not None:
            for part in spec.parts:  # name the part to blame, if one is refused on its own
                self._compile(part)
            raise _refusal(spec, error)
        return CompiledGrammar(spec, matcher, self.vocab_size)


def _first_step_error(template: LLMatcher, vocab_size: int) -> str | None:
    """llguidance's error when computing the first mask fails, on a copy of the template.

    A grammar whose language is empty (a `$ref` cycle, `[^\\s\\S]`, an empty intersection) builds
    without error; its matcher fails at the first mask, then allows only EOS and says it is stopped,
    and a request would end at once with an empty answer reported as a normal stop.
    """
    probe = template.deep_copy()
    mask = torch.zeros(bitmask_width(vocab_size), dtype=torch.int32)
    probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
    return probe.get_error() if probe.is_error() else None


def _grammar(spec: GuidedSpec, tokenizer: LLTokenizer) -> str:
    """llguidance's grammar text for the spec (not yet checked: building the matcher does that)."""
    if spec.kind in ("json_schema", "json_object"):
        options: JsonCompileOptions = {"whitespace_flexible": spec.any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        elif spec.any_whitespace:
            options["whitespace_pattern"] = BOUNDED_WHITESPACE
        return LLMatcher.grammar_from_json_schema(spec.text, overrides=options)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(spec.text))
        )
    if spec.kind == "grammar":
        try:
            lark = any_to_lark(spec.text)  # GBNF ("root ::= ...") to Lark; Lark passes through
        except Exception as exc:  # the converter raises its own error types and plain ones
            raise _refusal(spec, f"cannot read the grammar: {exc}") from exc
        return LLMatcher.grammar_from_lark(lark)
    tag = json.loads(spec.text)
    tags = [
        StructTag(trigger=spec.trigger_of(s["begin"]), begin=s["begin"], grammar=s["schema"], end=s["end"])
        for s in tag["structures"]
    ]
    # a trigger that is one special token of the vocabulary ("<|python_tag|>") is matched as that
    # token; any other trigger is matched as text
    special = all(_is_special(tokenizer, t) for t in tag["triggers"])
    return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags, assume_special=special))


def _is_special(tokenizer: LLTokenizer, text: str) -> bool:
    ids = tokenizer.tokenize_str(text, parse_special=True)
    return len(ids) == 1 and tokenizer.is_special_token(ids[0])


def _lltokenizer(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> LLTokenizer:
    if isinstance(tokenizer, LLTokenizer):
        return tokenizer
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)


def _refusal(spec: GuidedSpec, message: str) -> GuidedDecodingError:
    """The 400 for a spec the library refuses, with its reason on one line."""
    return library_refusal(spec.kind, spec.param, message, "cannot be used for guided decoding")


def _for_request(exc: GuidedDecodingError, spec: GuidedSpec) -> GuidedDecodingError:
    """A fresh error naming this request's field: a cached refusal may come from another request
    (equal specs may arrive through different fields), and one exception object shared by many
    raisers would collect all their tracebacks."""
    own = exc.param is not None and any(part.param == exc.param for part in spec.parts)
    return GuidedDecodingError(str(exc), code=exc.code, param=exc.param if own else spec.param)


def _result(future: Future[CompiledGrammar], spec: GuidedSpec) -> CompiledGrammar:
    try:
        return future.result()
    except GuidedDecodingError as exc:
        raise _for_request(exc, spec) from exc
