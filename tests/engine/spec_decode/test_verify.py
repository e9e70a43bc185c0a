"""Verification keeps the target's distribution (chi-square) and its argmax (greedy), row by row."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.verify import verify
from tests.engine.spec_decode.chi2 import chi2_limit

VOCAB = 6


def _seq(params: SamplingParams, generator: torch.Generator | None = None) -> Sequence:
    return Sequence(0, "r", 0, [1, 2, 3], params, 64, frozenset({5}), None, generator)


def _first_token_counts(logits: torch.Tensor, draft: int, runs: int, temperature: float) -> list[int]:
    counts = [0] * VOCAB
    shared = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature)
    for _ in range(runs):
        tokens, _ = verify(logits, _seq(params), [draft], shared)
        counts[tokens[0]] += 1
    return counts


def test_the_first_speculated_token_follows_the_target_distribution() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    logits = torch.stack([row, torch.zeros(VOCAB)])  # the second row: after an accepted draft
    runs = 6000
    for draft, temperature in ((0, 1.0), (3, 1.0), (1, 0.7)):  # likely, unlikely, and rescaled drafts
        p = torch.softmax(row / temperature, dim=-1).tolist()
        counts = _first_token_counts(logits, draft, runs, temperature)
        stat = sum((c - runs * q) ** 2 / (runs * q) for c, q in zip(counts, p, strict=True))
        assert stat < chi2_limit(VOCAB - 1), (draft, temperature, counts, p)
        assert 0 < counts[draft] < runs  # both accepted and rejected drafts were seen


def test_a_draft_outside_top_k_is_always_rejected() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    shared = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens, _ = verify(logits, _seq(params), [4], shared)
        assert tokens[0] in (0, 1) and len(tokens) == 1


def test_greedy_accepts_drafts_while_they_are_the_argmax_then_adds_the_models_token() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate((3, 1, 4, 2)):
        logits[row, best] = 1.0
    shared = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    assert verify(logits, _seq(greedy), [3, 1, 4], shared)[0] == [3, 1, 4, 2]  # all accepted + bonus
    assert verify(logits, _seq(greedy), [3, 0, 4], shared)[0] == [3, 1]  # second rejected: the argmax
    assert verify(logits, _seq(greedy), [0, 1, 4], shared)[0] == [3]


def test_penalties_and_min_tokens_see_the_drafts_before_each_row() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0  # token 2 is best everywhere...
    logits[:, 4] = 0.9
    shared = torch.Generator().manual_seed(0)
    # ...until it is in the output: a presence penalty then makes 4 the argmax of the next row
    penalized = SamplingParams(temperature=0, presence_penalty=0.5)
    assert verify(logits, _seq(penalized), [2, 2], shared)[0] == [2, 4]
    # min_tokens masks the stop token 5 while the output (drafts included) is too short
    logits[:, 5] = 5.0
    early = SamplingParams(temperature=0, min_tokens=2)
    seq = _seq(early)
    assert verify(logits, seq, [2, 5], shared)[0] == [2, 2]  # row 1: one output token before it
    assert verify(logits, seq, [2, 2], shared)[0] == [2, 2, 5]  # row 2: two before it, 5 allowed
    assert seq.token_ids == [1, 2, 3]  # the sequence is left as it was


def test_a_seeded_sequence_verifies_alike_every_time() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11)
    runs = [
        verify(logits, _seq(params, torch.Generator().manual_seed(11)), [1, 2, 3, 4], torch.Generator())[0]
        for _ in range(5)
    ]
    assert all(r == runs[0] for r in runs)


def test_logprobs_are_the_raw_rows_log_softmax_of_each_emitted_token() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0, logprobs=2)
    tokens, logprobs = verify(logits, _seq(params), best[:2], torch.Generator())
    assert tokens == best
    expected = torch.log_softmax(logits, dim=-1)
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp is not None
        assert lp[0] == float(expected[i, token]) and lp[1] == 1 and len(lp[2]) == 2
