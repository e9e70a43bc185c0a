"""Applying the token bitmask to logits: exactly the disallowed ids become -inf, nothing else moves."""

from __future__ import annotations

import pytest
import torch

from engine.guided import allocate_bitmask, apply_token_bitmask, bitmask_width


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[r, word]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def _random_bitmask(batch: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab)), generator=gen).to(torch.int32)


@pytest.mark.parametrize(("vocab", "width"), [(64, 64), (70, 70), (70, 100), (33, 33)])
def test_disallowed_ids_and_ids_past_the_vocabulary_become_minus_inf(vocab: int, width: int) -> None:
    bitmask = _random_bitmask(3, vocab, seed=vocab + width)
    logits = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    expected = _reference(logits, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_rows_apply_the_bitmask_to_those_logits_rows_only() -> None:
    bitmask = _random_bitmask(2, 96, seed=5)
    logits = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    expected = logits.clone()
    expected[[3, 1]] = _reference(logits[[3, 1]], bitmask)
    apply_token_bitmask(logits, bitmask, rows=[3, 1])
    assert torch.equal(logits, expected)


def test_a_fresh_bitmask_allows_every_token() -> None:
    logits = torch.randn(2, 50)
    before = logits.clone()
    apply_token_bitmask(logits, allocate_bitmask(2, 50))
    assert torch.equal(logits, before)
