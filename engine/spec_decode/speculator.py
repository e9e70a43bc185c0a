"""Speculator: which sequences speculate this step, their drafts, and what verification accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start, named after vLLM's spec_decode metrics; they only grow."""

    num_drafts: int  # verify passes of one sequence that carried drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # accepted drafts by position (0: the first draft)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class BatchProposer(Protocol):
    """Proposes for many sequences in one go (a draft model's batched passes)."""

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k drafts for each (sequence, k)."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget a sequence that left the running batch (finished, aborted or preempted)."""
        ...


class Speculator:
    """Proposes drafts for sequences in decode and learns from what was accepted.

    A sequence speculates unless its request opted out, a grammar guides it (its drafts would need
    the grammar's rollback: it decodes one token a step instead), or its drafts were accepted less
    than `min_acceptance_rate` over a window. The engine pauses speculation for `pause_steps` steps
    when the same holds over all sequences, and while more than `disable_by_batch_size` requests
    run, so a workload that cannot benefit pays only the (cheap) lookups of its probing windows.
    """

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: BatchProposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(*config.lookup_range)
        self.draft = draft  # draft_model: proposals in one batch after scheduling; else prompt lookup
        self._looked_up: dict[int, list[int]] = {}  # this step's prompt-lookup drafts by seq_id
        self._paused_until = 0  # step number
        self._step = 0
        self._window = [0, 0]  # engine-wide (drafted, accepted) in the current window
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._per_pos = [0] * config.num_speculative_tokens

    def begin_step(self, running: list[Sequence]) -> bool:
        """Start a step over the running batch; whether any sequence may speculate in it."""
        self._step += 1
        self._looked_up.clear()
        limit = self.config.disable_by_batch_size
        return self._step >= self._paused_until and (limit is None or len(running) <= limit)

    def room(self, seq: Sequence, cap: int) -> int:
        """How many drafts to make room for after a decoding sequence's last token (at most `cap`).

        Prompt lookup proposes here (the count is exact); a draft model proposes in `propose`, for
        all sequences at once, up to this many.
        """
        if seq.spec_off or seq.guided is not None or not seq.params.speculative:
            return 0
        k = min(
            self.config.num_speculative_tokens,
            cap,
            seq.max_tokens - seq.num_output_tokens - 1,  # the step emits up to k + 1 tokens
            self.max_model_len - seq.num_tokens - 1,
        )
        if k <= 0 or self.draft is not None:
            return max(k, 0)
        drafts = self.proposer.propose(seq.token_ids, k)
        self._looked_up[seq.seq_id] = drafts
        return len(drafts)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """The drafts of each (sequence, room) `room` gave this step (up to room of them)."""
        if self.draft is not None:
            return self.draft.propose(wants)
        return [self._looked_up.pop(seq.seq_id, [])[:k] for seq, k in wants]

    def release(self, seq: Sequence) -> None:
        """A sequence left the running batch: what the draft model holds for it goes back."""
        if self.draft is not None:
            self.draft.release(seq.seq_id)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """What one verify pass of `seq` accepted (the leading `num_accepted` of its drafts)."""
        self._drafts += 1
        self._draft_tokens += num_drafted
        self._accepted += num_accepted
        for pos in range(num_accepted):
            self._per_pos[pos] += 1
        cfg = self.config
        seq.spec_drafted += num_drafted
        seq.spec_accepted += num_accepted
        if seq.spec_drafted >= cfg.acceptance_window:
            seq.spec_off = seq.spec_accepted < cfg.min_acceptance_rate * seq.spec_drafted
            seq.spec_drafted = seq.spec_accepted = 0
        window = self._window
        window[0] += num_drafted
        window[1] += num_accepted
        if window[0] >= 4 * cfg.acceptance_window:
            if window[1] < cfg.min_acceptance_rate * window[0]:
                self._paused_until = self._step + cfg.pause_steps
            window[0] = window[1] = 0

    def stats(self) -> SpecDecodeStats:
        """The counters now."""
        return SpecDecodeStats(self._drafts, self._draft_tokens, self._accepted, tuple(self._per_pos))
