"""Scheduler: iteration-level continuous batching with chunked prefill and recompute preemption."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import Speculator


@dataclass
class ScheduledSeq:
    """A sequence and how many of its tokens this step computes.

    With `spec_tokens` (speculative decoding) the step computes the sequence's last token and
    those drafts after it: num_new_tokens = 1 + len(spec_tokens), one sampled row per token.
    """

    seq: Sequence
    num_new_tokens: int
    spec_tokens: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (so a new token is sampled)."""
        computed = self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_tokens)
        return computed == self.seq.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits this step gives the sequence: 0, 1, or 1 + its drafts."""
        return 1 + len(self.spec_tokens) if self.samples else 0

    @property
    def is_decode(self) -> bool:
        """One new token on top of an already computed context."""
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens > 0


@dataclass
class SchedulerOutput:
    """What one engine step runs, decodes first (the model runner relies on that order)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the step's flattened batch."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step."""
        return not self.scheduled


class Scheduler:
    """Decides, every step, which tokens of which sequences run.

    Each step first continues running sequences (decodes and unfinished prefill chunks) in
    admission order, preempting the most recently admitted one when blocks run out, then
    admits waiting sequences (preempted ones are at the front) within the token budget.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first, then admissions."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # memory is tight after a preemption: admit nobody this step
            self._schedule_waiting(out, budget)
        out.scheduled.sort(key=lambda s: not s.is_decode)  # speculating decodes are not: drafts follow
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        running = self.running
        speculate = self.speculator is not None and self.speculator.begin_step(running)
        wants: list[tuple[ScheduledSeq, int]] = []  # decodes with room for drafts
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, seq
            while not bm.can_append_slots(seq, num_new):
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                # drafts only where they fit: never preempt, nor crowd a later decode out, for them
                room = self._room(seq, budget - (len(running) - i)) if speculate and num_new == 1 else 0
                bm.append_slots(seq, num_new + room)
                scheduled = ScheduledSeq(seq, num_new)
                out.scheduled.append(scheduled)
                if room:
                    wants.append((scheduled, room))
                budget -= num_new + room
                i += 1
        if wants:
            self._add_drafts(wants)
        return budget

    def _room(self, seq: Sequence, cap: int) -> int:
        """Drafts a decoding sequence may carry this step (0 where its blocks would not fit)."""
        assert self.speculator is not None
        if seq.num_computed_tokens == 0 or cap <= 0:
            return 0
        room = self.speculator.room(seq, cap)
        return room if room and self.block_manager.can_append_slots(seq, 1 + room) else 0

    def _add_drafts(self, wants: list[tuple[ScheduledSeq, int]]) -> None:
        """The speculator's drafts onto their scheduled decodes (fewer than their room is fine: the
        blocks left over go back after the step)."""
        assert self.speculator is not None
        drafts = self.speculator.propose([(s.seq, room) for s, room in wants])
        for (scheduled, room), tokens in zip(wants, drafts, strict=True):
            scheduled.spec_tokens = tokens[:room]
            scheduled.num_new_tokens = 1 + len(scheduled.spec_tokens)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order, except those whose next uncached block a running
        sequence is computing right now: they wait for it and then find it cached, rather than
        computing the same prefix beside it (two requests with one new system prompt)."""
        bm = self.block_manager
        pending = self._pending_blocks() if self.waiting and bm.enable_prefix_caching else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_blocks(seq)
            reusable = (seq.num_tokens - 1) // bm.block_size  # blocks a hit may cover (one token computed)
            if pending and len(cached) < reusable and seq.block_hashes[len(cached)] in pending:
                deferred.append(self.waiting.popleft())
                continue
            num_cached_tokens = len(cached) * bm.block_size
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if not bm.can_allocate(seq, cached, num_new):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached, num_new)
            bm.record_prefix_query(seq.num_tokens, num_cached_tokens)
            if seq.num_preemptions == 0:  # the prompt's hits (a resumed request's replayed answer
                # hits too: counted there, cached_tokens passed prompt_tokens and the gateway
                # disbelieved the whole usage)
                seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if bm.enable_prefix_caching:
                pending.update(seq.block_hashes[len(cached) :])
        self.waiting.extendleft(reversed(deferred))  # they keep their places at the front

    def _pending_blocks(self) -> set[int]:
        """Hashes of the full prompt blocks running sequences have yet to compute."""
        bs = self.block_manager.block_size
        return {h for seq in self.running for h in seq.block_hashes[seq.num_computed_tokens // bs :]}

    def _preempt(self, seq: Sequence) -> None:
        """Recompute, not swap: drop the KV (cached blocks stay reusable) and requeue at the front."""
        self.block_manager.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache.

        A speculating sequence's `num_new_tokens` says by now how many of its positions hold KV of
        accepted tokens; the blocks past what it still needs go back (rejected drafts' slots are
        simply written again later), and blocks are published only up to accepted tokens.
        """
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.trim(s.seq)  # room made for drafts and not needed (a no-op otherwise)
            self.block_manager.cache_full_blocks(s.seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish a sequence and free its blocks at once (they are reusable next step)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.finish(reason, stop_reason)
