"""Sequence: one stream of tokens being generated, with its status and block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.guided import GuidedMatcher
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None
    # the token's own bytes where decoded_token lost some (part of a character: U+FFFD), else None
    decoded_bytes: bytes | None = None


class Sequence:
    """One generated stream: prompt, output so far, KV block table and bookkeeping.

    A request with `n > 1` owns n sequences that share the prompt (and, through the
    prefix cache, its KV blocks).
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer | None,
        generator: torch.Generator | None,
        arrival_time: float | None = None,
        guided: GuidedMatcher | None = None,
        seed: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, the model's input
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.detokenizer = detokenizer
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()  # bad_words' tokens (the sampler's to forbid)
        self.generator = generator
        # with `generator`: the sequence's seed (`seeded_generator`); a generator given without one
        # keeps the seed it was given
        self.seed = seed if seed is not None or generator is None else generator.initial_seed()
        # its own state in the request's grammar (n > 1: one each); it has accepted every output
        # token, so recompute preemption, which keeps the tokens, leaves it valid
        self.guided = guided
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_published_blocks = 0  # leading blocks already offered to the prefix cache
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when asked for
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        # a resumed sequence: the text of the output it was resumed with, which the reader already
        # has (its stream state is rebuilt from it); handed out once by the first delta
        self.replayed_text = ""
        # speculative decoding: drafted and accepted tokens in the current window, and whether the
        # sequence stopped speculating (its drafts were rarely accepted)
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_off = False
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value}, "
            f"tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the sequence stopped (for any reason)."""
        return self.status is SequenceStatus.FINISHED

    def seeded_generator(self) -> torch.Generator | None:
        """The sequence's generator seeded for the output position it samples next (None: unseeded).

        Every position draws from its own seed (the sequence's, mixed with the position), not from
        a state carried from one token to the next: a completion resumed on another replica after
        k tokens draws exactly what this one would have (the gateway's stream resumption), and
        speculative decoding's extra draws do not shift later positions.
        """
        if self.generator is None:
            return None
        assert self.seed is not None
        return self.generator.manual_seed(position_seed(self.seed, self.num_output_tokens))

    def take_text(self) -> str:
        """The output text decided since the last call (all that is left once finished)."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.take(final=self.is_finished)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token (its KV is computed by the next step)."""
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished; the caller frees the blocks."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic()


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (any of [-2^63, 2^64)): each of
    the 2^64 states a generator takes is one seed (the request's range folded onto 64 bits; folded
    onto 63, 42 and 42 + 2^63 drew the same answer), each choice a state of its own."""
    return (seed + index * 0x9E3779B9) & _MASK64


def position_seed(seed: int, position: int) -> int:
    """A seed for output `position` of a sequence seeded with `seed` (splitmix64 over both)."""
    z = (seed ^ ((position + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
