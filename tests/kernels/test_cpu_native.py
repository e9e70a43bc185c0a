"""Building and loading the C CPU kernels (kernels/cpu_native.py): cached, atomic, and optional."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernels import cpu_native

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


@needs_compiler
def test_the_build_is_cached_per_source_and_machine(tmp_path: Path) -> None:
    built = cpu_native.load(tmp_path / "kernels")
    assert built is not None and built.path.parent == tmp_path / "kernels"
    ones = torch.ones(2, 32)
    assert built.gemm(torch.ones(1, 32), built.gemm.pack(ones), 2).tolist() == [[32.0, 32.0]]
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.path.name]  # no partial file left
    mtime = built.path.stat().st_mtime_ns
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    assert cpu_native._built(tmp_path / "kernels", compiler) == built.path  # found, not rebuilt
    assert built.path.stat().st_mtime_ns == mtime
    assert cpu_native.load(tmp_path / "kernels") is built  # one load per process


def test_without_a_compiler_the_kernel_is_none_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert cpu_native.load(tmp_path / "kernels", compiler="no-such-cc-here") is None
    assert "no C compiler" in caplog.text
    assert not (tmp_path / "kernels").exists()


@needs_compiler
def test_a_failing_build_leaves_no_library_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\necho broken >&2\nexit 3\n'
    )
    compiler.chmod(0o755)
    assert cpu_native.load(tmp_path / "kernels", compiler=str(compiler)) is None
    assert "exited with 3" in caplog.text and "broken" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []


def test_another_instruction_set_is_passed_to_the_compiler_and_built_apart(tmp_path: Path) -> None:
    """`march` replaces -march=native (a build for the code an older CPU runs), under its own key."""
    args = tmp_path / "args"
    compiler = tmp_path / "cc"
    compiler.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
        f'echo "$@" >> {args}\n'
        'while [ "$1" != -o ]; do shift; done\necho fake > "$2"\n'  # the library the build writes
    )
    compiler.chmod(0o755)
    haswell = cpu_native._built(tmp_path / "kernels", str(compiler), march="haswell")
    native = cpu_native._built(tmp_path / "kernels", str(compiler))
    assert haswell != native and haswell.exists() and native.exists()
    first, second = (line.split() for line in args.read_text().splitlines())
    assert "-march=haswell" in first and "-march=native" not in first
    assert "-march=native" in second and "-march=haswell" not in second
    assert cpu_native._built(tmp_path / "kernels", str(compiler), march="haswell") == haswell  # cached
    assert len(args.read_text().splitlines()) == 2
