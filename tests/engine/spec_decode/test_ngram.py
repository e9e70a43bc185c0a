"""Prompt lookup: the longest earlier occurrence of the suffix proposes what followed it."""

from __future__ import annotations

from engine.spec_decode.ngram import NgramProposer


def test_proposes_what_followed_the_latest_occurrence_of_the_suffix() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 2) == [7, 8]  # the later "1 2 3" wins over the first


def test_prefers_the_longest_suffix_that_occurred() -> None:
    # "2 3" last occurred before 6, but "1 2 3" (longer) occurred before 4
    tokens = [1, 2, 3, 4, 5, 0, 2, 3, 6, 5, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 1) == [4]
    assert NgramProposer(2, 2).propose(tokens, 1) == [6]


def test_no_earlier_occurrence_proposes_nothing() -> None:
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5, 6], 4) == []
    assert NgramProposer(1, 1).propose([5], 4) == []
    assert NgramProposer(1, 4).propose([5, 5], 0) == []


def test_proposal_is_cut_at_k_and_at_the_end_of_the_sequence() -> None:
    tokens = [4, 5, 6, 7, 8, 9, 4, 5]
    assert NgramProposer(2, 2).propose(tokens, 3) == [6, 7, 8]
    assert NgramProposer(1, 1).propose([3, 3, 3], 5) == [3]  # latest "3" is followed by one token
