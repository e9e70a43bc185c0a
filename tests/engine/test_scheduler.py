"""Scheduler: continuous batching, chunked prefill, preemption order, resumption."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BS = 4


def _seq(seq_id: int, prompt_len: int) -> Sequence:
    tokens = [seq_id * 1000 + i for i in range(prompt_len)]
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(), 64, frozenset(), None, None)


def _run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, pretend the model ran, and append a token to each sequence that sampled."""
    out = sched.schedule()
    sampled = [s.seq for s in out.scheduled if s.samples]
    sched.update_after_step(out.scheduled)
    for seq in sampled:
        seq.append_token(7)
    return out


def test_decodes_run_first_and_long_prompt_is_chunked_within_budget() -> None:
    sched = Scheduler(BlockManager(64, BS, True), max_num_seqs=8, max_num_batched_tokens=16)
    short = _seq(0, 3)
    sched.add(short)
    _run_step(sched)  # short prefilled, now decoding
    long = _seq(1, 40)
    sched.add(long)
    chunks = []
    for _ in range(4):
        out = _run_step(sched)
        assert out.scheduled[0].seq is short and out.scheduled[0].num_new_tokens == 1
        assert out.num_batched_tokens <= 16
        chunks.append(out.scheduled[1].num_new_tokens)
        if len(chunks) == 2:
            assert long.num_output_tokens == 0  # nothing sampled from a partial prefill
    assert chunks == [15, 15, 10, 1]
    assert long.num_output_tokens == 2


def test_preempts_most_recent_sequence_when_blocks_run_out() -> None:
    bm = BlockManager(6, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first, second, third = _seq(0, 8), _seq(1, 7), _seq(2, 7)
    for s in (first, second, third):
        sched.add(s)
    _run_step(sched)  # 2 + 2 + 2 blocks: the pool is full
    assert bm.num_free_blocks == 0
    out = _run_step(sched)  # `first` needs a third block: the most recently admitted (`third`) goes
    assert out.preempted == [third]
    assert third.status is SequenceStatus.WAITING and third.block_table == []
    assert third.num_computed_tokens == 0 and third.num_preemptions == 1
    assert sched.waiting[0] is third


def test_preempted_sequence_resumes_before_new_admissions() -> None:
    bm = BlockManager(6, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = _seq(0, 8), _seq(1, 7), _seq(2, 7)
    for s in (a, b, c):
        sched.add(s)
    _run_step(sched)
    _run_step(sched)  # c preempted
    newcomer = _seq(3, 2)
    sched.add(newcomer)
    sched.finish(b, "stop")  # frees room
    out = _run_step(sched)
    admitted = [s.seq for s in out.scheduled if s.seq is not a]
    assert admitted[0] is c
    assert c.num_computed_tokens > 0


def test_finished_sequence_frees_its_slot_for_the_next_step() -> None:
    sched = Scheduler(BlockManager(32, BS, True), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _seq(0, 5), _seq(1, 5)
    sched.add(a)
    sched.add(b)
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == [a]
    sched.finish(a, "length")
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == [b]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = Scheduler(BlockManager(64, BS, True), max_num_seqs=2, max_num_batched_tokens=256)
    seqs = [_seq(i, 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = _run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_all_blocks_free_after_finish_and_preemption() -> None:
    bm = BlockManager(6, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(0, 8), _seq(1, 7), _seq(2, 7)]
    for s in seqs:
        sched.add(s)
    for _ in range(20):
        _run_step(sched)
        for s in list(sched.running):
            if s.num_output_tokens >= 3:
                sched.finish(s, "length")
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_counters_count_queried_and_hit_tokens() -> None:
    bm = BlockManager(32, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first = _seq(0, 10)
    sched.add(first)
    _run_step(sched)
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    twin = Sequence(
        1, "r1", 0, first.prompt_token_ids[:9] + [5, 6], SamplingParams(), 8, frozenset(), None, None
    )
    sched.add(twin)
    _run_step(sched)
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)  # two full blocks of the shared 9 tokens
    assert twin.num_cached_tokens == 8
    assert twin.block_table[:2] == first.block_table[:2]


def _shared(seq_id: int, prefix_len: int, tail: int) -> Sequence:
    tokens = [500 + i for i in range(prefix_len)] + [seq_id * 1000 + i for i in range(tail)]
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(), 64, frozenset(), None, None)


def test_a_prefix_being_computed_is_waited_for_then_found_cached_not_computed_twice() -> None:
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=12)
    first, second, other = _shared(1, 24, 3), _shared(2, 24, 5), _seq(3, 6)
    for s in (first, second, other):
        sched.add(s)
    out = _run_step(sched)  # first's prefill starts; second would compute the same blocks: it waits
    assert [s.seq for s in out.scheduled] == [first]
    assert list(sched.waiting) == [second, other]  # and keeps its place
    out = _run_step(sched)  # first's second chunk takes the whole budget
    assert [s.seq for s in out.scheduled] == [first] and second.status is SequenceStatus.WAITING
    _run_step(sched)  # first's 27 tokens are in: the 24-token prefix (6 blocks) is cached
    while second.status is SequenceStatus.WAITING:
        _run_step(sched)
    assert second.num_cached_tokens == 24  # found cached: only its own 5 tokens computed
    assert bm.prefix_hits == 24
    assert other.num_cached_tokens == 0 and other.status is SequenceStatus.RUNNING


def test_sequences_arriving_together_with_one_new_prefix_compute_it_once() -> None:
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    seqs = [_shared(i, 32, 2) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == [seqs[0]]  # one computes the 8 shared blocks
    out = _run_step(sched)
    assert {s.seq for s in out.scheduled if not s.is_decode} == set(seqs[1:])
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32, 32]


def test_without_prefix_caching_nothing_waits() -> None:
    sched = Scheduler(BlockManager(64, BS, False), max_num_seqs=8, max_num_batched_tokens=256)
    seqs = [_shared(i, 32, 2) for i in range(1, 4)]
    for s in seqs:
        sched.add(s)
    assert [s.seq for s in _run_step(sched).scheduled] == seqs
