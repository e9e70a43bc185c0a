"""A compiled grammar, one sequence's state in it (GuidedMatcher), and the batch mask fill.

State lives in llguidance's LLMatcher: a template per compiled grammar, never advanced, copied
for each sequence (~0.04 ms), so the n choices of one request and every request with the same
constraint start from one compile. The sequence feeds it each token it appends; before a
step, every guided sequence writes its row of one bitmask (`BitmaskFiller`), which
`engine.guided.bitmask.apply_token_bitmask` then applies to the logits.

Thread-safety: a GuidedMatcher belongs to the step loop's thread (one writer; the bitmask fill
reads it). The template is only copied, which llguidance does under the GIL, so the compiler's
threads and the step loop can copy one template at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLExecutor, LLMatcher

from engine.guided.bitmask import bitmask_width
from engine.guided.errors import GuidedDecodingError, library_refusal
from engine.guided.spec import GuidedSpec


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for one tokenizer: the start-state matcher that sequences copy."""

    spec: GuidedSpec
    template: LLMatcher
    vocab_size: int  # bitmask rows cover this many ids (the model's logits width)

    def matcher(self) -> GuidedMatcher:
        """A fresh state at the start of the grammar, for one sequence."""
        return GuidedMatcher(self)


class GuidedMatcher:
    """One sequence's state in its grammar: accept tokens, fill its bitmask row, rebuild from tokens."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = compiled.template.deep_copy()
        self._tokens: list[int] = []  # accepted so far: what a refused token's repair replays
        self.refusal: str | None = None  # why the last refused token was refused (llguidance's words)

    @property
    def num_tokens(self) -> int:
        """Tokens accepted since the start of the grammar."""
        return len(self._tokens)

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False (state unchanged) when the grammar does not allow it."""
        # a matcher in an error state (a parser limit met while computing its mask) allows only EOS
        # and says it is stopped: that is a failure, never the end of a whole output
        if (
            not self._matcher.is_error()
            and self._matcher.consume_token(token)
            and not self._matcher.is_error()
        ):
            self._tokens.append(token)
            return True
        self.refusal = self._matcher.get_error() or "the grammar does not allow this token"
        # llguidance leaves a matcher that refused a token in an error state for good (rollback
        # included), so the state is rebuilt from the accepted tokens; only a caller that skipped
        # the mask gets here, so the replay costs nothing in normal decoding
        self.rebuild(self._tokens)
        return False

    def failure(self) -> GuidedDecodingError:
        """The request's error when a token its mask allowed is refused: llguidance checks its parser
        limits (items per row, lexer states) only while consuming, so a grammar too large for them
        (a schema with hundreds of alternatives) can allow a token that it then cannot take."""
        spec, verdict = self.compiled.spec, "is too complex for guided decoding"
        return library_refusal(spec.kind, spec.param, self.refusal or "", verdict)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ((batch, words) int32, CPU, contiguous)."""
        target = _row(bitmask, row, self.compiled.vocab_size)
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def is_terminated(self) -> bool:
        """Nothing but a stop token can follow (the grammar is complete), or a stop token was accepted.

        The sequence can finish here: its output is whole, and the mask would force EOS anyway.
        """
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The tokens so far form a complete output (a stop token is allowed next)."""
        return self._matcher.is_accepting()

    def rebuild(self, tokens: Sequence[int]) -> bool:
        """Reset to the start and replay `tokens` (a sequence's output after recompute preemption).

        False when the grammar refuses one of them: the state then holds the longest accepted prefix.
        """
        tokens = list(tokens)
        self._matcher = self.compiled.template.deep_copy()
        self._tokens = []
        accepted = self._matcher.validate_tokens(tokens)
        if accepted:
            assert self._matcher.consume_tokens(tokens[:accepted])
            self._tokens = tokens[:accepted]
        return accepted == len(tokens)

    def allowed_tokens(self) -> list[int]:
        """The ids the grammar allows next (tests and debugging; the step loop uses the bitmask)."""
        bitmask = torch.zeros((1, bitmask_width(self.compiled.vocab_size)), dtype=torch.int32)
        self.fill_bitmask(bitmask, 0)
        bits = (
            bitmask.view(torch.uint8).unsqueeze(-1).bitwise_right_shift(torch.arange(8, dtype=torch.uint8))
            & 1
        )
        return [int(i) for i in bits.flatten().nonzero().flatten() if i < self.compiled.vocab_size]


class BitmaskFiller:
    """Fills the rows of many matchers in one call, on llguidance's own threads.

    Measured at batch 64 on the 2-core CPU: 0.70 ms a step against 0.77 for a Python loop over
    `GuidedMatcher.fill_bitmask` (nested schema), 0.22 against 0.86 (any JSON object); the call
    drops the GIL (docs/BENCHMARKS.md, "Guided decoding").
    """

    def __init__(self, threads: int = 2) -> None:
        self._executor = LLExecutor(num_threads=threads)

    def fill(self, matchers: Sequence[GuidedMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` gets matchers[i]'s allowed tokens; all matchers share one vocabulary."""
        if not matchers:
            return
        vocab = matchers[0].compiled.vocab_size
        assert all(m.compiled.vocab_size == vocab for m in matchers)
        assert bitmask.shape[0] >= len(matchers)
        _row(bitmask, 0, vocab)  # the checks: dtype, device, width, contiguity
        words = bitmask.shape[1]
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, bitmask.shape[0])


def _row(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """bitmask[row], after the checks that make writing through its pointer safe."""
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.dim() == 2
    assert bitmask.is_contiguous() and bitmask.shape[1] == bitmask_width(vocab_size), (
        bitmask.shape,
        vocab_size,
    )
    assert 0 <= row < bitmask.shape[0]
    return bitmask[row]
