"""`serve`'s uvicorn, one process or a supervisor of workers, stopping alike on signals.

First SIGTERM/SIGINT: requests in flight have the grace period (GATEWAY_SHUTDOWN_TIMEOUT), then are
cut off: answered 503 `gateway_shutdown`, logged, the request log flushed, exit 0. Second: the grace
period ends now, with the same cut-off, so that an impatient operator loses no request's log row
(uvicorn's own second signal skips the app's shutdown: rows unwritten, reservations held). Third:
at once. With `--workers N` uvicorn's supervisor sent its workers one SIGTERM and left any later
signal unread; ours sends that SIGTERM, then each further stop as a SIGUSR1, which its workers count
as the single server counts its signals. Not a SIGTERM each: systemd's stop (KillMode=control-group,
its default) and dumb-init signal every process of the group, so each worker got that SIGTERM and
the supervisor's, and counting both ended the grace period at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from contextlib import suppress
from multiprocessing.connection import wait
from types import FrameType

import uvicorn
from uvicorn.supervisors import multiprocess
from uvicorn.supervisors.multiprocess import Multiprocess, Process

logger = logging.getLogger(__name__)

_STOPS = (signal.SIGINT, signal.SIGTERM)
_FURTHER_STOP = signal.SIGUSR1  # the supervisor's word to its workers: one more stop signal came


class CleanExitServer(uvicorn.Server):
    """uvicorn that finishes its graceful shutdown on SIGTERM/SIGINT and exits 0 (no re-raise); a
    second signal ends the grace period, a third exits at once (the module's docstring)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = asyncio.Event()  # set by the second signal

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start, noting its loop (where a signal hands its word to the shutdown)."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal, in the main thread between two of the loop's steps: it only leaves word."""
        self._signals += 1
        self.should_exit = True
        if self._signals == 2 and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._hurry.set)  # (closed: it ended, nothing to hurry)
        elif self._signals >= 3:
            self.force_exit = True

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the requests in flight, cut short by a second signal as if the grace
        period had ended (uvicorn's shutdown then cancels them and runs the app's shutdown)."""
        waiting = asyncio.ensure_future(super()._wait_tasks_to_complete())
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({waiting, hurry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
        if not waiting.done():
            waiting.cancel()
            logger.warning("a second signal: the requests in flight are cut off now")
            raise TimeoutError
        waiting.result()


class _WorkerServer(CleanExitServer):
    """A worker's server: it counts its supervisor's word only, a first SIGTERM then SIGUSR1s.

    Ctrl-C at a terminal signals the whole process group, workers included, and the supervisor
    forwards that SIGINT as a SIGTERM too: counting both, one Ctrl-C would end the grace period.
    systemd's stop does the same with SIGTERM: only the first SIGTERM counts.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first SIGTERM and each SIGUSR1 count; SIGINT, or another SIGTERM, reached the
        supervisor too, which forwards it."""
        if sig == _FURTHER_STOP:
            if not self._signals:  # it overtook the SIGTERM sent before it (Python runs the
                super().handle_exit(signal.SIGTERM, frame)  # handlers of a lower number first)
            super().handle_exit(sig, frame)
        elif sig == signal.SIGTERM and not self._signals:
            super().handle_exit(sig, frame)


class _Worker(Process):
    """uvicorn's worker process (health pings, sockets from the supervisor), serving _WorkerServer."""

    @property
    def server(self) -> uvicorn.Server:
        """The worker's server, made in the worker process."""
        if self._server is None:
            self._server = _WorkerServer(self.config)
        return self._server

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover
        """In the worker: SIGINT ignored from the start (until its server counts signals, a Ctrl-C
        would raise KeyboardInterrupt in the middle of its start-up), the supervisor's SIGUSR1
        counted by its server (uvicorn's handles SIGINT and SIGTERM only), then uvicorn's target."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(_FURTHER_STOP, self.server.handle_exit)
        super().target(sockets)


class WorkerSupervisor(Multiprocess):
    """uvicorn 0.54's supervisor of `--workers N` (restarts a dead or hung worker, SIGHUP replaces
    them all, SIGTTIN/SIGTTOU add or remove one), its workers serving _WorkerServer, and every stop
    signal forwarded to them.

    uvicorn makes its workers in four methods, naming its Process class by a global name: `run`
    rebinds it to _Worker, so that none of uvicorn's code is repeated here.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self._stops = 0  # SIGINT and SIGTERM received; terminate_all forwards the first

    @property
    def signalled(self) -> bool:
        """Whether a stop signal ended the run (else a worker failed to start, and it stopped itself)."""
        return self._stops > 0

    def handle_int(self) -> None:
        """Ctrl-C: stop (uvicorn's), counted."""
        self._stops += 1
        super().handle_int()

    def handle_term(self) -> None:
        """SIGTERM: stop (uvicorn's), counted."""
        self._stops += 1
        super().handle_term()

    def join_all(self) -> None:
        """Wait for the workers, forwarding each further stop signal to them as a SIGUSR1 (uvicorn
        left them in its queue: its workers had their whole grace period however often one asked)."""
        forwarded = 1  # terminate_all's SIGTERM
        while alive := [p for p in self.processes if p.process.is_alive()]:
            for sig in tuple(self.signal_queue):
                self.signal_queue.remove(sig)
                if sig in _STOPS:
                    self._stops += 1
                else:  # a restart or another worker, while they stop: no
                    logger.info("stopping: signal %s ignored", signal.Signals(sig).name)
            for _ in range(forwarded, self._stops):
                logger.info("a further stop signal: forwarded to the workers")
                for worker in alive:
                    assert worker.pid is not None
                    with suppress(ProcessLookupError):  # it has just exited
                        os.kill(worker.pid, _FURTHER_STOP)
            forwarded = max(forwarded, self._stops)
            wait([p.process.sentinel for p in alive], timeout=0.1)
        super().join_all()

    def run(self) -> None:
        """uvicorn's supervision, its workers made as `_Worker`s: each of uvicorn's methods that
        makes one (start, restart, SIGHUP, SIGTTIN) names the class by its module's global `Process`,
        which is rebound for the run (tests/gateway/cli/test_serving.py checks that they still do).
        The supervisor process does nothing else meanwhile."""
        made_by = multiprocess.Process
        multiprocess.Process = _Worker  # type: ignore[misc]
        try:
            super().run()
        finally:
            multiprocess.Process = made_by  # type: ignore[misc]
