"""The engine's one wall: its HTTP layer (engine/http/) sits on the core; the core never imports it,
and the engine never imports the gateway (they talk HTTP only)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_engine_core_never_imports_its_http_layer() -> None:
    core = [p for p in ENGINE.rglob("*.py") if "http" not in p.relative_to(ENGINE).parts[:1]]
    core = [p for p in core if p.name != "__main__.py"]  # the command line starts the server
    upward = sorted(
        f"{p.relative_to(ENGINE.parent)} -> {m}"
        for p in core
        for m in _imports(p)
        if m == "engine.http" or m.startswith("engine.http.")
    )
    assert len(core) > 20 and not upward, upward


def test_the_engine_never_imports_the_gateway() -> None:
    wrong = sorted(
        f"{p.relative_to(ENGINE.parent)} -> {m}"
        for p in ENGINE.rglob("*.py")
        for m in _imports(p)
        if m == "gateway" or m.startswith("gateway.")
    )
    assert not wrong, wrong


def test_docs_architecture_md_names_every_engine_command_and_only_files_that_exist(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine.__main__ import parse_args

    doc = (ENGINE.parent / "docs" / "architecture.md").read_text()
    listed = re.search(r"engine/__main__\.py +python -m engine ([\w| -]+)", doc)
    assert listed is not None
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    usage = re.search(r"\{([\w,-]+)\}", capsys.readouterr().out)
    assert usage is not None
    assert {c.strip() for c in listed.group(1).split("|")} == set(usage.group(1).split(","))
    # a file named with its folder is there, from the repository or from its room (gateway/, engine/)
    named = set(re.findall(r"[\w./-]+/[\w.-]*\w\.(?:py|c|h|json|yaml)\b", doc))
    roots = [ENGINE.parent, ENGINE.parent / "gateway", ENGINE]
    assert sorted(n for n in named if not any((root / n).exists() for root in roots)) == []
