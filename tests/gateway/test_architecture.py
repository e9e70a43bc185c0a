"""The gateway's rooms and floors (gateway/__init__.py, docs/architecture.md): every import of one
gateway module by another goes to its own room or a lower floor, and modules import no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
# rooms by floor, lowest first; a room may import its own floor's rooms only where listed together
FLOORS: list[tuple[str, ...]] = [
    ("errors",),
    ("config",),
    ("store",),
    ("governance", "backends"),
    ("routing",),
    ("telemetry",),
    ("pipeline",),
    ("api",),
    ("console",),
    ("cli",),
    ("main", "__main__"),
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _module(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The gateway modules `path` imports (type-checking-only imports too: they are a dependency)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gateway":
                found.update(f"gateway.{alias.name}" for alias in node.names)
            elif node.module.startswith("gateway."):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gateway."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(path): path for path in GATEWAY.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else "main"


def test_every_module_belongs_to_a_room_on_a_floor() -> None:
    assert {_room(m) for m in _graph()} - {"main"} <= set(FLOOR), "a new room needs a floor here"


def test_no_import_runs_up_a_floor() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _room(module) != _room(target) and FLOOR[_room(target)] >= FLOOR[_room(module)]
    ]
    assert not upward, "imports against the floors:\n" + "\n".join(sorted(upward))


def test_gateway_modules_import_no_cycle() -> None:
    graph, done, path = _graph(), set[str](), list[str]()

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _environment_writes(path: Path) -> list[str]:
    """Where `path` changes os.environ: item assignment or deletion, a mutating method, putenv."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        written = [t.value for t in targets if isinstance(t, ast.Subscript)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("setdefault", "update", "pop", "popitem", "clear", "__setitem__"):
                written.append(node.func.value)
            elif node.func.attr in ("putenv", "unsetenv"):
                found.append(f"{path.name}:{node.lineno}")
        found += [
            f"{path.name}:{node.lineno}" for v in written if ast.unparse(v) in ("os.environ", "environ")
        ]
    return found


def test_only_the_entry_point_writes_the_process_environment() -> None:
    writes = [
        f"{_module(path)}: {where}"
        for path in sorted(GATEWAY.rglob("*.py"))
        if path.name != "__main__.py"
        for where in _environment_writes(path)
    ]
    assert not writes, "library modules writing os.environ:\n" + "\n".join(writes)
