"""The sampler's top-k / top-p / min-p filter on hand-made logits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from engine import SamplingParams
from engine.sampler import apply_top_k_top_p_min_p


def _rows(*params: SamplingParams) -> Any:
    return [SimpleNamespace(params=p) for p in params]


def test_a_top_k_past_the_vocabulary_keeps_every_token_even_past_int64() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]])
    seqs = _rows(SamplingParams(top_k=2**64), SamplingParams(top_k=5), SamplingParams(top_k=2, top_p=0.999))
    out = apply_top_k_top_p_min_p(logits.clone(), seqs)
    assert torch.equal(out[:2], logits[:2])  # the two huge top_k rows are untouched
    assert torch.isinf(out[2]).tolist() == [True, False, True, False]  # the mixed batch still filters row 3
