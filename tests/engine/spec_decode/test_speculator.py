"""The speculator's own switches: opt-outs, draft length bounds, the engine-wide pause, batch size."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode import SpeculativeConfig, Speculator

REPEATING = [5, 6, 7, 8] * 8


def _seq(params: SamplingParams | None = None, max_tokens: int = 64, output: int = 0) -> Sequence:
    seq = Sequence(0, "r", 0, REPEATING, params or SamplingParams(), max_tokens, frozenset(), None, None)
    for i in range(output):  # the output goes on repeating the prompt
        seq.append_token(REPEATING[i])
    return seq


def _drafts(spec: Speculator, seq: Sequence, cap: int) -> list[int]:
    room = spec.room(seq, cap)
    return spec.propose([(seq, room)])[0] if room else []


def test_drafts_never_run_past_max_tokens_or_the_context() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    assert _drafts(spec, _seq(), cap=10) == [5, 6, 7, 8]
    assert len(_drafts(spec, _seq(), cap=2)) == 2  # the step's token budget
    assert len(_drafts(spec, _seq(max_tokens=10, output=7), cap=10)) == 2  # 3 left: 2 drafts + 1
    assert _drafts(spec, _seq(max_tokens=10, output=9), cap=10) == []
    short = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=len(REPEATING) + 2)
    assert len(_drafts(short, _seq(), cap=10)) == 1


def test_opted_out_sequences_never_get_drafts() -> None:
    spec = Speculator(SpeculativeConfig(), max_model_len=1000)
    assert spec.room(_seq(SamplingParams(speculative=False)), cap=10) == 0
    off = _seq()
    off.spec_off = True
    assert spec.room(off, cap=10) == 0


def test_low_acceptance_over_all_sequences_pauses_speculation_for_pause_steps() -> None:
    config = SpeculativeConfig(acceptance_window=4, min_acceptance_rate=0.5, pause_steps=3)
    spec = Speculator(config, max_model_len=1000)
    assert spec.begin_step([_seq()])
    for i in range(4):  # 16 drafted, 1 accepted, spread over sequences (none reaches its own window)
        spec.record(_seq(), 4, 1 if i == 0 else 0)
    assert [spec.begin_step([_seq()]) for _ in range(4)] == [False, False, True, True]
    assert spec.stats().num_draft_tokens == 16 and spec.stats().accepted_per_pos == (1, 0, 0, 0)


def test_more_running_requests_than_disable_by_batch_size_turns_it_off() -> None:
    spec = Speculator(SpeculativeConfig(disable_by_batch_size=4), max_model_len=1000)
    assert spec.begin_step([_seq()] * 4) and not spec.begin_step([_seq()] * 5) and spec.begin_step([_seq()])
