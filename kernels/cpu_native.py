"""The CPU kernels written in C (cpu_gemm.c, cpu_decode.c, cpu_stack.c; cpu_vec.h), built on this
machine on first use.

The sources are compiled by the machine's C compiler (`cc`, else `gcc`) with `-march=native` into
one library in a cache folder the engine names, under a file name that hashes the sources, the
flags, the compiler's version and the CPU's feature flags (a home shared with other CPUs gets its
own build). The build writes a private file and renames it into place, so engines and test workers
starting together never load half a library. Without a compiler, or when the build or the load
fails, `load` logs why once and returns None: the engine then keeps the torch operations (correct,
slower at batch 1). OpenMP comes from torch's own runtime (the library is loaded after torch, which
already holds libgomp.so.1), so `torch.set_num_threads` sets these kernels' threads too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kernels.cpu_decode import CpuDecode
from kernels.cpu_gemm import CpuGemm
from kernels.cpu_stack import CpuStack

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_gemm.c", "cpu_decode.c", "cpu_stack.c"))
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_TIMEOUT = 120.0  # seconds; a build takes about one


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library's launchers."""

    gemm: CpuGemm
    decode: CpuDecode
    stack: CpuStack
    path: Path


def load(cache_dir: Path, compiler: str | None = None, march: str = "native") -> CpuKernels | None:
    """The kernels built for this machine under `cache_dir` (built now if missing), or None.
    `march`: another instruction set than this CPU's (`haswell`: AVX2 and FMA, no AVX-512, no
    VNNI), for tests and benchmarks of the code an older CPU runs; this CPU must run it."""
    return _load(Path(cache_dir), compiler, march)


@lru_cache(maxsize=8)
def _load(cache_dir: Path, compiler: str | None, march: str) -> CpuKernels | None:
    cc = compiler or shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which(cc) is None:
        logger.warning(
            "no C compiler found (cc, gcc): the CPU decode path stays on torch operations (slower)"
        )
        return None
    try:
        path = _built(cache_dir, cc, march)
        library = ctypes.CDLL(str(path))
        return CpuKernels(CpuGemm(library), CpuDecode(library), CpuStack(library), path)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("the CPU kernels could not be built or loaded (%s): torch operations stay in use", exc)
        return None


def _built(cache_dir: Path, cc: str, march: str = "native") -> Path:
    """The library's path, compiling it first unless a build for these sources, flags, compiler and
    CPU exists."""
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    parts = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode(), version.encode(), _cpu_flags()]))
    target = cache_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        command = [cc, *flags, *map(str, SOURCES), "-lm", "-o", partial]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("built the CPU kernels: %s", target)
    return target


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what -march=native compiles for); empty where /proc has none."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            for line in info:
                if line.startswith(b"flags"):
                    return line.strip()
    except OSError:
        pass
    return b""
