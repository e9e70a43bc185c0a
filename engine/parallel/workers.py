"""Worker processes of a tensor-parallel engine, and the step inputs the driver sends them.

Rank 0 (the engine's own process, the driver) schedules, prepares and samples; ranks 1..N-1 are
worker processes started here (torch.multiprocessing, spawn). Every step the driver broadcasts what
its batch preparation reads of each scheduled sequence (`StepInput`); each worker rebuilds the same
batch over its own KV shard and runs the same forward, so the collectives inside the model (the
row-parallel all-reduces, the vocabulary gather) pair up. A worker exits when the driver sends None
(shutdown) or when a collective times out (the driver is gone).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.parallel.group import TensorParallelGroup, init_group

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)
ADDRESS = "127.0.0.1"


@dataclass(frozen=True)
class StepInput:
    """What batch preparation reads of one scheduled sequence (its new tokens only)."""

    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    tokens: list[int]  # token_ids from num_computed_tokens on, as far as this step reads
    num_new_tokens: int
    spec_tokens: list[int]


class _Window:
    """token_ids as batch preparation slices them, holding only the tokens from `offset` on."""

    def __init__(self, offset: int, tokens: list[int]) -> None:
        self.offset, self.tokens = offset, tokens

    def __getitem__(self, index: slice) -> list[int]:
        start = (index.start or 0) - self.offset
        stop = None if index.stop is None else index.stop - self.offset
        assert start >= 0, "a step reads only its new tokens"
        return self.tokens[start:stop]


class _SeqView:
    """A scheduled sequence as a worker sees it."""

    def __init__(self, step: StepInput) -> None:
        self.num_computed_tokens = step.num_computed_tokens
        self.num_tokens = step.num_tokens
        self.block_table = step.block_table
        self.token_ids = _Window(step.num_computed_tokens, step.tokens)


def step_inputs(scheduled: list[ScheduledSeq]) -> list[StepInput]:
    """The driver's batch, as the workers need it."""
    out = []
    for s in scheduled:
        seq = s.seq
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens - len(s.spec_tokens)
        out.append(StepInput(start, seq.num_tokens, list(seq.block_table), seq.token_ids[start:end],
                             s.num_new_tokens, list(s.spec_tokens)))  # fmt: skip
    return out


def rebuild(steps: list[StepInput]) -> list[ScheduledSeq]:
    """The driver's batch on a worker."""
    from engine.scheduler import ScheduledSeq

    return [ScheduledSeq(cast(Any, _SeqView(s)), s.num_new_tokens, list(s.spec_tokens)) for s in steps]


def free_port() -> int:
    """A TCP port free right now on the loopback (the group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((ADDRESS, 0))
        return int(sock.getsockname()[1])


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads for one rank: the engine's threads (or the machine's cores) shared by the ranks."""
    total = config.num_threads or os.cpu_count() or 1
    return max(1, total // config.tensor_parallel_size)


def start_workers(
    config: EngineConfig, model_dir: Path, max_model_len: int, device: torch.device
) -> tuple[TensorParallelGroup, list[Any]]:
    """Start ranks 1..N-1 and join the group as rank 0; returns (the driver's group, the processes)."""
    size = config.tensor_parallel_size
    port = free_port()
    context = mp.get_context("spawn")
    processes = [
        context.Process(
            target=worker_main, args=(rank, config, str(model_dir), max_model_len, port), daemon=True
        )
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    try:
        group = init_group(0, size, ADDRESS, port, device)
    except BaseException:
        stop_workers(processes)
        raise
    return group, processes


def stop_workers(processes: list[Any], timeout: float = 10.0) -> None:
    """End the worker processes (after the driver's None, they exit by themselves)."""
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()


def worker_main(rank: int, config: EngineConfig, model_dir: str, max_model_len: int, port: int) -> None:
    """A worker rank: load its shard, then run every step the driver sends until it sends None."""
    from engine.model_runner import ModelRunner, resolve_device
    from engine.models.config import ModelConfig

    torch.set_num_threads(threads_per_rank(config))
    device = resolve_device(config)
    group = init_group(rank, config.tensor_parallel_size, ADDRESS, port, device)
    try:
        path = Path(model_dir)
        runner = ModelRunner(config, ModelConfig.from_dir(path), path, max_model_len, group)
        runner.follow_driver()
    finally:
        group.close()
