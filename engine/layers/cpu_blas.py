"""Row-invariant matrix products on CPU: what batch-invariant mode stands on.

Batch invariance on the torch path needs `F.linear(x, w)[i]` to be bit-identical whatever the
number of rows of `x`. MKL does not promise that: on AVX-512 Intel CPUs its sgemm picks different
kernels for 1, 2-3 (or 2-15) and more rows, so a request's logits change with the batch beside it.
The engine pads a batch-invariant step's rows to a multiple of 4 (kernels.reference.ROW_MULTIPLE),
so only row counts of that form have to agree: on the AVX-512 AMD EPYC machines (Zen 4) 1-3 rows
round differently from 4 or more whatever the mode, and 4 and more all agree. MKL's strict
Conditional Numerical Reproducibility mode (`MKL_CBWR=AUTO,STRICT`) computes every
row the same way on the instructions the CPU has; measured here it costs the engine nothing that
matters (docs/BENCHMARKS.md). It is a process-wide setting that MKL accepts only before its first
call, so `engine serve` and the tests ask for it first thing, and the model runner asks again
(harmless when already set) and then checks the products it relies on with `rows_are_invariant`.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# mkl_service.h
MKL_CBWR_ALL = ~0
MKL_CBWR_AUTO = 2
MKL_CBWR_STRICT = 0x10000
MKL_CBWR_SUCCESS = 0

# the row counts a probe compares: MKL's kernel boundaries seen so far are 1 | 2-3 | 4-15 | 16+,
# each rounded up to the engine's row multiple
PROBE_ROWS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 33, 64, 65, 130)


def _mkl() -> ctypes.CDLL | None:
    """torch's own MKL (linked into libtorch_cpu), or None when this torch has none."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(lib))
        mkl.mkl_serv_cbwr_set.restype = mkl.mkl_serv_cbwr_get.restype = ctypes.c_int
    except (OSError, AttributeError):  # another platform or build: the probe decides alone
        return None
    return mkl


@lru_cache(maxsize=1)
def request_strict_mkl() -> bool:
    """Ask MKL for strict reproducible mode; True when it is on (now or already)."""
    mkl = _mkl()
    if mkl is None:
        return False
    status = mkl.mkl_serv_cbwr_set(MKL_CBWR_AUTO | MKL_CBWR_STRICT)
    strict = bool(mkl.mkl_serv_cbwr_get(MKL_CBWR_ALL) & MKL_CBWR_STRICT)
    if status != MKL_CBWR_SUCCESS and not strict:  # MKL ran before us: the mode is fixed now
        logger.debug("MKL refused strict reproducible mode (status %d)", status)
    return strict


@lru_cache(maxsize=8)
def rows_are_invariant(dtype: torch.dtype = torch.float32, width: int = 576, multiple: int = 1) -> bool:
    """Whether F.linear gives each row the same bits whatever the number of rows beside it, for
    row counts that are multiples of `multiple` (the engine pads its batches to one)."""
    gen = torch.Generator().manual_seed(0)
    counts = sorted({-(-rows // multiple) * multiple for rows in PROBE_ROWS})
    x = torch.randn(counts[-1], width, generator=gen).to(dtype)
    w = torch.randn(3 * width, width, generator=gen).to(dtype)
    first = F.linear(x[: counts[0]], w)[0]
    return all(torch.equal(F.linear(x[:rows], w)[0], first) for rows in counts[1:])


def batch_invariant_linear(dtype: torch.dtype, width: int, multiple: int) -> bool:
    """Make this process's products row-invariant if MKL allows; False (and a warning) when they
    are not (for row counts that are multiples of `multiple`), so that the engine serves, and
    says it serves, without batch invariance."""
    request_strict_mkl()
    if rows_are_invariant(dtype, width, multiple):
        return True
    logger.warning(
        "batch invariance is off: this CPU's BLAS rounds a row differently with the batch beside it "
        "and MKL's strict reproducible mode could not be set (MKL ran before the engine started; "
        "set MKL_CBWR=AUTO,STRICT in the environment)"
    )
    return False
