"""Draft-model proposals: a smaller model with the same tokenizer proposes k tokens, greedily, from
its own paged KV cache.

Each speculating sequence has a `DraftState` here: the draft model's block table and how many of
the sequence's tokens its KV holds. A proposal first catches the draft up on the tokens it has not
seen (the prompt the first time, then the tokens accepted since; in chunks within the step's token
budget), which gives the first draft, then runs k - 1 one-token steps; every pass is batched over
the sequences that speculate. Drafts are the draft model's argmax: a point mass, which is what
verification's acceptance rule expects. After verification the draft's KV is valid only up to the
sequence's accepted tokens; the next proposal starts from there (rejected drafts' slots are simply
written again). A sequence that leaves the running batch (finished, aborted, preempted) gives its
draft blocks back; when the draft's pool is full a sequence just proposes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, cast

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.default_model import resolve_model
from engine.kv_sizing import KVCompanion, kv_bytes_per_block
from engine.model_runner import TORCH_DTYPES, ModelRunner, resolve_device, resolve_dtype
from engine.models.config import ModelConfig
from engine.planner import weight_bytes
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.tokenizer import has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class DraftState:
    """A sequence as the draft model's KV holds it (what ModelRunner.prepare reads of a sequence)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_published_blocks = 0  # the draft pool has no prefix cache: never published

    @property
    def num_tokens(self) -> int:
        """Tokens the next pass sees (the sequence's, then drafts as they come)."""
        return len(self.token_ids)


class DraftProposer:
    """Runs the draft model over the speculating sequences and keeps its KV per sequence."""

    def __init__(self, runner: ModelRunner, target_vocab: int, max_num_batched_tokens: int) -> None:
        self.runner = runner
        layout = runner.layout
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
        self.target_vocab = target_vocab
        self.max_num_batched_tokens = max_num_batched_tokens
        self._states: dict[int, DraftState] = {}

    @classmethod
    def load(
        cls, path: str, config: EngineConfig, model_config: ModelConfig, tokenizer: Any, max_model_len: int,
        token_slots: int,
    ) -> DraftProposer:  # fmt: skip
        """The draft model at `path`, checked against the target (tokenizer, vocabulary, context), with
        a KV pool of `token_slots` tokens (as many as the target's)."""
        draft_dir = resolve_model(path)
        draft_config = ModelConfig.from_dir(draft_dir)
        _check_compatible(draft_dir, draft_config, model_config, tokenizer, max_model_len)
        dtype = resolve_dtype(config, resolve_device(config))
        per_token = kv_bytes_per_block(draft_config, 1, dtype, "auto")
        options = dataclasses.replace(
            config,
            model=str(draft_dir),
            quantization=None,
            kv_cache_dtype="auto",
            kv_cache_memory=max(token_slots * per_token, 1 << 20),
            speculative_config=None,
        )
        runner = ModelRunner(options, draft_config, draft_dir, max_model_len)
        logger.info("draft model %s: %d KV blocks", draft_dir, runner.layout.num_blocks)
        return cls(runner, model_config.vocab_size, config.max_num_batched_tokens)

    @staticmethod
    def footprint(path: str, config: EngineConfig) -> KVCompanion:
        """What the draft model at `path` will take of the device: its weights and KV per token."""
        draft_config = ModelConfig.from_dir(resolve_model(path))
        dtype = resolve_dtype(config, resolve_device(config))
        name = next(k for k, v in TORCH_DTYPES.items() if v == dtype)
        return KVCompanion(
            weight_bytes(draft_config, name, None), kv_bytes_per_block(draft_config, 1, dtype, "auto")
        )

    def release(self, seq_id: int) -> None:
        """Give back a sequence's draft blocks (it left the running batch)."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self.block_manager.free(cast(Any, state))

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k greedy drafts for each (sequence, k); [] where the draft is not caught up or full."""
        drafts: list[list[int]] = [[] for _ in wants]
        active: list[tuple[int, DraftState, int]] = []  # (index in wants, state, k)
        budget = self.max_num_batched_tokens
        for i, (seq, k) in enumerate(wants):
            state = self._states.setdefault(seq.seq_id, DraftState())
            # the draft's KV is valid up to the sequence's accepted tokens, the last one excluded
            state.num_computed_tokens = min(state.num_computed_tokens, seq.num_tokens - 1)
            state.token_ids = list(seq.token_ids)
            behind = state.num_tokens - state.num_computed_tokens
            if behind > budget:  # catch up by a chunk within the step's budget; propose once caught up
                if budget > 0 and self.block_manager.can_append_slots(cast(Any, state), budget):
                    self.block_manager.append_slots(cast(Any, state), budget)
                    self._run([(state, budget)])
                    state.num_computed_tokens += budget
                budget = 0
                continue
            if not self.block_manager.can_append_slots(cast(Any, state), behind + k - 1):
                continue
            self.block_manager.append_slots(cast(Any, state), behind + k - 1)
            budget -= behind
            active.append((i, state, k))
        step = 0
        while active:
            work = [(state, state.num_tokens - state.num_computed_tokens) for _, state, _ in active]
            chosen = self._run(work)
            for (i, state, _), token in zip(active, chosen, strict=True):
                state.num_computed_tokens = state.num_tokens
                state.token_ids.append(token)
                drafts[i].append(token)
            step += 1
            active = [a for a in active if a[2] > step]
        return drafts

    def _run(self, work: list[tuple[DraftState, int]]) -> list[int]:
        """One draft forward over each state's next `n` tokens (blocks already given); the argmax
        after each state that reaches its last token, in `work`'s order."""
        # the runner wants decodes (one token over a context) first, as the scheduler orders a step
        decode = [n == 1 and state.num_computed_tokens > 0 for state, n in work]
        order = sorted(range(len(work)), key=lambda j: not decode[j])
        scheduled = [ScheduledSeq(cast(Any, work[j][0]), work[j][1]) for j in order]
        logits = self.runner.execute(scheduled)[:, : self.target_vocab]
        tokens = [int(t) for t in logits.argmax(dim=-1).tolist()]
        sampled = [j for j, s in zip(order, scheduled, strict=True) if s.samples]
        by_work = dict(zip(sampled, tokens, strict=True))
        return [by_work[j] for j in range(len(work)) if j in by_work]


def _check_compatible(
    draft_dir: Path, draft: ModelConfig, target: ModelConfig, tokenizer: Any, max_model_len: int
) -> None:
    """ValueError unless the draft speaks the target's tokens over the target's context."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size}) is larger than the "
            f"target's ({target.vocab_size}): it needs the same tokenizer"
        )
    if (tokenizer is None) != (not has_tokenizer(draft_dir)):
        raise ValueError("speculative_config.model: one model has a tokenizer and the other does not")
    if tokenizer is not None and load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError("speculative_config.model: the draft model's tokenizer differs from the target's")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft model's context ({draft.max_position_embeddings} tokens) "
            f"is shorter than max_model_len ({max_model_len}): lower max_model_len"
        )
