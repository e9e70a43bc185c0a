"""TensorParallelGroup: one rank's view of the tensor-parallel world (gloo on CPU, NCCL on CUDA).

Each engine gets a process group of its own (a TCPStore rendezvous and a ProcessGroupGloo or
ProcessGroupNCCL object), not torch.distributed's global default group: a process can then build,
close and build again tensor-parallel engines (tests do), and nothing global is left behind.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_IDLE_WAIT = datetime.timedelta(days=365)  # a worker's wait for the next step: without a limit


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's rank among `size`, and the process group its collectives run on."""

    rank: int
    size: int
    group: Any  # ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # the rendezvous store (kept alive with the group)
    device: torch.device
    timeout: datetime.timedelta = datetime.timedelta(seconds=60)  # a step's collectives

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, samples and sends every step's inputs to the others."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (row-parallel outputs), in place."""
        self.group.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (vocabulary-parallel logits)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: Any, idle: bool = False) -> Any:
        """The driver's `obj` on every rank (pickled: a step's inputs are small). `idle`: a worker
        waiting for the next step, which comes with the next request, however late: that wait has
        no time limit (a worker notices a dead driver otherwise: engine/parallel/workers.py)."""
        data = pickle.dumps(obj) if self.is_driver else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        if idle:
            options.timeout = _IDLE_WAIT  # gloo reads the operation's own limit
            self._default_timeout(_IDLE_WAIT)  # NCCL's watchdog: the group's, when the work is made
        try:
            work = self.group.broadcast([length], options)
        finally:
            if idle:
                self._default_timeout(self.timeout)
        work.wait()
        payload = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.is_driver
            else torch.empty(int(length), dtype=torch.uint8, device=self.device)
        )
        self.group.broadcast(payload, 0).wait()
        return obj if self.is_driver else pickle.loads(payload.cpu().numpy().tobytes())

    def _default_timeout(self, limit: datetime.timedelta) -> None:
        setter = getattr(self.group, "_set_default_timeout", None)
        if setter is not None:
            setter(limit)

    def close(self) -> None:
        """Leave the group (its sockets close; a rank still waiting on it gets an error)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()


def init_group(
    rank: int, size: int, address: str, port: int, device: torch.device, timeout: float
) -> TensorParallelGroup:
    """Join the group (every rank calls it with the same address and port; rank 0 hosts the store).

    A collective (or the rendezvous) that waits longer than `timeout` seconds means a rank died or
    hangs: it raises, the step fails, and the engine stops instead of waiting forever."""
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        address, port, size, is_master=rank == 0, timeout=limit
    )
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, limit)
    return TensorParallelGroup(rank, size, group, store, device, limit)
