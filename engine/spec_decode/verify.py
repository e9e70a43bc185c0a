"""Verification: which proposed tokens the target model's own choice accepts, and the one after.

The target ran over the sequence's last token plus k drafts, giving k+1 rows of logits: row i is
the distribution of the token after draft i-1. Greedy: drafts are accepted while they equal the
row's argmax; the first row that disagrees (or the row after the last draft) gives the token the
model chose itself, so the output is exactly what one-token decoding gives. Sampled: each row draws
the token the plain sampler would draw at that position (its own noise), and a draft is accepted
while it is that token. The drafts come from a proposer that is sure of them (a point mass), so this
keeps draft i with the target's probability p(draft), as Leviathan et al.'s rule with q = 1 at the
draft does, and the emitted tokens are the ones decoding without drafts gives: for a seeded request,
the same tokens whatever the batch, the per-request opt-out, or a resumption on another replica.

Each row is processed as the sampler would process it with the sequence standing at that position
(penalties and min_tokens see the drafts before it), so every sampling parameter keeps its meaning.
"""

from __future__ import annotations

import torch

from engine.sampler import (
    apply_penalties,
    apply_top_k_top_p_min_p,
    mask_stop_tokens_before_min,
    sampled_logprob,
)
from engine.sequence import Sequence

SampledLogprob = tuple[float, int, list[tuple[int, float]]]


@torch.inference_mode()
def verify(
    logits: torch.Tensor, seq: Sequence, drafts: list[int], shared: torch.Generator
) -> tuple[list[int], list[SampledLogprob | None]]:
    """The tokens to emit (accepted drafts, then one of the model's own) and their logprobs.

    logits: (len(drafts) + 1, vocab) float32; `shared` draws for sequences without a seed.
    """
    assert logits.shape[0] == len(drafts) + 1 and seq.guided is None
    params = seq.params
    logits = logits.float()
    if params.is_greedy and not params.has_penalties and seq.num_output_tokens >= params.min_tokens:
        targets = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], int(targets[accepted])]
        return tokens, _logprobs(logits, tokens, params.logprobs)
    tokens = []
    try:
        for i in range(len(drafts) + 1):
            row = _processed(logits[i : i + 1], seq)
            draft = drafts[i] if i < len(drafts) else None
            # a seeded sequence draws from its position's own seed (a resumed one draws the same)
            token, accepted = _choose(row, seq, draft, seq.seeded_generator() or shared)
            tokens.append(token)
            seq.token_ids.append(token)  # for a moment: the next row's penalties and min_tokens see it
            if not accepted:
                break
    finally:
        del seq.token_ids[len(seq.token_ids) - len(tokens) :]
    return tokens, _logprobs(logits, tokens, params.logprobs)


def _processed(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row as the sampler leaves it before choosing: penalties, then min_tokens' mask."""
    if seq.params.has_penalties:
        row = apply_penalties(row.clone(), [seq])
    if seq.num_output_tokens < seq.params.min_tokens:
        row = mask_stop_tokens_before_min(row.clone(), [seq])
    return row


def _choose(
    row: torch.Tensor, seq: Sequence, draft: int | None, generator: torch.Generator
) -> tuple[int, bool]:
    """(token, whether it is the draft): the token the plain sampler would draw at this position,
    with its own noise (engine/sampler.py: argmax of p / Exp(1)), and the draft kept when it is that
    token. Exact for any proposal (the emitted token is a draw from p whatever was drafted), as
    likely to keep a one-token draft as rejection sampling (p(draft)), and a seeded sequence emits
    the same tokens with or without drafts: whatever the batch, the speculation flag, or a stream
    resumed on a replica whose drafts differ."""
    params = seq.params
    if params.is_greedy:
        token = int(row.argmax(dim=-1))
        return token, token == draft
    temperature = torch.tensor([params.temperature], device=row.device)  # as the sampler's batch divides
    probs = torch.softmax(apply_top_k_top_p_min_p(row / temperature[:, None], [seq]), dim=-1)[0]
    noise = torch.empty_like(probs).exponential_(generator=generator)
    token = int((probs / noise).argmax())
    return token, token == draft


def _logprobs(logits: torch.Tensor, tokens: list[int], num_top: int | None) -> list[SampledLogprob | None]:
    """Each emitted token's logprob under the model's raw distribution at its row (as the sampler)."""
    if num_top is None:
        return [None] * len(tokens)
    lp = torch.log_softmax(logits[: len(tokens)], dim=-1)
    return [sampled_logprob(lp[i], token, num_top) for i, token in enumerate(tokens)]
