"""Verification: which proposed tokens the target model's own choice accepts, and the one after.

The target ran over the sequence's last token plus k drafts, giving k+1 rows of logits: row i is
the distribution of the token after draft i-1. Greedy: drafts are accepted while they equal the
row's argmax; the first row that disagrees (or the row after the last draft) gives the token the
model chose itself, so the output is exactly what one-token decoding gives. Sampled: the drafts
come from a proposer that is sure of them (a point mass), so draft i is accepted with the target's
probability p(draft) and, when rejected, the token is drawn from p with the draft removed; the
emitted token then follows p exactly (Leviathan et al.'s rule with q = 1 at the draft).

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
    """(token, whether it is the draft): argmax, or the rule that keeps the target's distribution."""
    params = seq.params
    if params.is_greedy:
        token = int(row.argmax(dim=-1))
        return token, token == draft
    probs = torch.softmax(apply_top_k_top_p_min_p(row / params.temperature, [seq]), dim=-1)[0]
    vocab = probs.shape[0]
    if draft is not None and draft < vocab:
        u = float(torch.rand(1, generator=generator, device=probs.device))
        if u < float(probs[draft]):
            return draft, True
        probs = probs.clone()
        probs[draft] = 0.0  # the residual max(p - q, 0) for a point-mass proposal
        if not bool((probs > 0).any()):  # p was the draft alone (u rounding): nothing else to pick
            return draft, True
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax()), False


def _logprobs(logits: torch.Tensor, tokens: list[int], num_top: int | None) -> list[SampledLogprob | None]:
    """Each emitted token's logprob under the model's raw distribution at its row (as the sampler)."""
    if num_top is None:
        return [None] * len(tokens)
    lp = torch.log_softmax(logits[: len(tokens)], dim=-1)
    return [sampled_logprob(lp[i], token, num_top) for i, token in enumerate(tokens)]
