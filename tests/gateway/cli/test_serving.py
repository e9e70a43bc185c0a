"""`serve --workers N`: uvicorn's supervisor, every worker it makes serving our server class."""

from __future__ import annotations

import ast
import asyncio
import inspect
import signal

import uvicorn
from uvicorn.supervisors import multiprocess

from gateway.cli.serving import _FURTHER_STOP, WorkerSupervisor, _WorkerServer


def test_uvicorn_makes_every_worker_by_the_global_name_that_our_supervisor_rebinds() -> None:
    # WorkerSupervisor.run rebinds uvicorn's module global `Process` to its own worker class: that
    # covers every worker uvicorn makes (start, restart, SIGHUP, SIGTTIN) only while each is made by
    # that name; one made otherwise would be a worker that a second signal forces out unlogged
    tree = ast.parse(inspect.getsource(multiprocess))
    makers = {
        method.name
        for method in ast.walk(tree)
        if isinstance(method, ast.FunctionDef)
        for call in ast.walk(method)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Process"
    }
    assert makers == {"init_processes", "keep_subprocess_alive", "restart_all", "handle_ttin"}
    assert "run" in vars(WorkerSupervisor)


def test_a_worker_told_of_a_further_stop_after_its_loop_closed_exits_quietly() -> None:
    # the supervisor's SIGUSR1 stays handled for the worker's life: one that comes as the worker
    # exits, its server's loop closed, must not raise (a traceback on the way out)
    server = _WorkerServer(uvicorn.Config(app="gateway.main:app"))  # not loaded here
    loop = asyncio.new_event_loop()
    loop.close()
    server._loop = loop
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(_FURTHER_STOP, None)
    assert server.should_exit
