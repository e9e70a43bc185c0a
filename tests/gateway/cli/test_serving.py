"""`serve --workers N`: uvicorn's supervisor, every worker it makes serving our server class."""

from __future__ import annotations

import ast
import inspect

from uvicorn.supervisors import multiprocess

from gateway.cli.serving import WorkerSupervisor


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
