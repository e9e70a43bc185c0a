"""`serve --workers N`: uvicorn's supervisor, every worker it makes serving our server class."""

from __future__ import annotations

import ast
import inspect

from uvicorn.supervisors.multiprocess import Multiprocess

from gateway.cli.serving import WorkerSupervisor


def test_every_supervisor_method_that_makes_a_worker_is_overridden_to_make_ours() -> None:
    # uvicorn names its Process class where it makes a worker (start, restart, SIGHUP, SIGTTIN): a
    # method not overridden would bring back workers that a second signal forces out unlogged
    tree = ast.parse(inspect.getsource(Multiprocess))
    makers = {
        method.name
        for method in ast.walk(tree)
        if isinstance(method, ast.FunctionDef)
        for call in ast.walk(method)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Process"
    }
    assert makers == {"init_processes", "keep_subprocess_alive", "restart_all", "handle_ttin"}
    assert all(name in vars(WorkerSupervisor) for name in makers)
