"""Worker processes of a tensor-parallel engine, and the step inputs the driver sends them.

Rank 0 (the engine's own process, the driver) schedules, prepares and samples; ranks 1..N-1 are
worker processes started here (torch.multiprocessing, spawn). Every step the driver broadcasts what
its batch preparation reads of each scheduled sequence (`StepInput`); each worker rebuilds the same
batch over its own KV shard and runs the same forward, so the collectives inside the model (the
row-parallel all-reduces, the vocabulary gather) pair up. A worker exits when the driver sends None
(shutdown), when a step's collective times out or its peer is gone, or when its parent process is
gone; its wait for the next step has no time limit (an engine may sit idle for hours).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
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
_PARENT_POLL_SECONDS = 0.5


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


@dataclass(frozen=True)
class Topology:
    """Where the ranks run, by torchrun's convention: NNODES nodes, this one NODE_RANK, the group's
    rendezvous at MASTER_ADDR:MASTER_PORT (rank 0's node). Unset: one node, the loopback, a free port."""

    address: str
    port: int
    nnodes: int
    node_rank: int

    @classmethod
    def from_env(cls, size: int, environ: Mapping[str, str] | None = None) -> Topology:
        env = os.environ if environ is None else environ
        nnodes, node_rank = int(env.get("NNODES", "1")), int(env.get("NODE_RANK", "0"))
        if nnodes < 1 or size % nnodes or not 0 <= node_rank < nnodes:
            raise ValueError(
                f"NNODES={nnodes} must divide tensor_parallel_size={size}, "
                f"and NODE_RANK={node_rank} be below NNODES"
            )
        if nnodes > 1 and not env.get("MASTER_PORT"):
            raise ValueError("several nodes need MASTER_ADDR and MASTER_PORT (rank 0's node and a free port)")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else free_port()
        return cls(env.get("MASTER_ADDR", ADDRESS), port, nnodes, node_rank)

    def local_ranks(self, size: int) -> range:
        """The ranks this node runs."""
        per_node = size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def threads_per_rank(config: EngineConfig, topology: Topology | None = None) -> int:
    """CPU threads for one rank: the engine's threads (or the machine's cores) shared by this node's ranks."""
    total = config.num_threads or os.cpu_count() or 1
    nnodes = topology.nnodes if topology is not None else 1
    return max(1, total * nnodes // config.tensor_parallel_size)


def _spawn(
    config: EngineConfig, model_dir: Path, max_model_len: int, topology: Topology, ranks: range
) -> list[Any]:
    context = mp.get_context("spawn")
    processes = [
        context.Process(
            target=worker_main, args=(rank, config, str(model_dir), max_model_len, topology), daemon=True
        )
        for rank in ranks
    ]
    for process in processes:
        process.start()
    return processes


def start_workers(
    config: EngineConfig, model_dir: Path, max_model_len: int, device: torch.device
) -> tuple[TensorParallelGroup, list[Any]]:
    """On rank 0's node: start this node's other ranks and join the group as rank 0 (other nodes run
    `python -m engine worker`); returns (the driver's group, the local worker processes)."""
    size = config.tensor_parallel_size
    topology = Topology.from_env(size)
    if topology.node_rank != 0:
        raise ValueError("the engine (rank 0) runs on NODE_RANK 0; other nodes run `python -m engine worker`")
    processes = _spawn(config, model_dir, max_model_len, topology, topology.local_ranks(size)[1:])
    try:
        group = init_group(0, size, topology.address, topology.port, device, config.distributed_timeout)
    except BaseException:
        stop_workers(processes)
        raise
    return group, processes


def run_node(config: EngineConfig, model_dir: Path, max_model_len: int) -> int:
    """`python -m engine worker` on a node other than rank 0's: run its ranks until they end; the
    exit code is non-zero when one of them failed."""
    size = config.tensor_parallel_size
    topology = Topology.from_env(size)
    if topology.node_rank == 0:
        raise ValueError("NODE_RANK 0 runs the engine itself (`python -m engine serve`), not a worker")
    processes = _spawn(config, model_dir, max_model_len, topology, topology.local_ranks(size))
    for process in processes:
        process.join()
    return max((abs(p.exitcode or 0) for p in processes), default=0)


def stop_workers(processes: list[Any], timeout: float = 10.0) -> None:
    """End the worker processes (after the driver's None, they exit by themselves)."""
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()


def _exit_with_parent(parent: int) -> None:
    """Exit once the process that started this worker is gone. A worker's wait for the next step
    has no time limit (the engine may sit idle), and a parent killed outright (SIGKILL) neither
    stops its daemonic workers nor, with NCCL, closes anything a waiting collective would notice."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(
    rank: int, config: EngineConfig, model_dir: str, max_model_len: int, topology: Topology
) -> None:
    """A worker rank: load its shard, then run every step the driver sends until it sends None."""
    from engine.model_runner import ModelRunner, resolve_device
    from engine.models.config import ModelConfig

    _exit_with_parent(os.getppid())
    torch.set_num_threads(threads_per_rank(config, topology))
    local_rank = rank - topology.local_ranks(config.tensor_parallel_size).start
    if resolve_device(config).type == "cuda":  # one GPU per rank of this node
        config = dataclasses.replace(config, device=f"cuda:{local_rank}")
    device = resolve_device(config)
    size = config.tensor_parallel_size
    group = init_group(rank, size, topology.address, topology.port, device, config.distributed_timeout)
    try:
        path = Path(model_dir)
        runner = ModelRunner(config, ModelConfig.from_dir(path), path, max_model_len, group)
        runner.follow_driver()
    finally:
        group.close()
