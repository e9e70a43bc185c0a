"""The C float32 gemv (kernels/cpu_gemv.c) against F.linear, and its row invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import kernel_cache_dir
from kernels import cpu_native

KERNELS = cpu_native.load(kernel_cache_dir())
GEMV = None if KERNELS is None else KERNELS.gemv
needs_gemv = pytest.mark.skipif(GEMV is None, reason="no C compiler on this machine")


@needs_gemv
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [
        (1, 576, 960),
        (2, 1536, 576),
        (3, 64, 7),
        (5, 100, 33),
        (1, 7, 5),
        (4, 31, 1),
        (9, 48, 130),
        (1, 16, 3),
    ],
)
def test_gemv_equals_f_linear(rows: int, k: int, n: int) -> None:
    """Every K (multiples of 32 and 16, scalar tails) and every row count (tiles of 4 and their rest)."""
    assert GEMV is not None
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    got = GEMV(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-4)


@needs_gemv
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    assert GEMV is not None
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(11, 200, generator=gen), torch.randn(301, 200, generator=gen)
    alone = torch.cat([GEMV(x[i : i + 1].contiguous(), w) for i in range(11)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert GEMV.max_threads() == count  # torch's OpenMP runtime, shared
            for rows in (2, 3, 4, 5, 11):
                assert torch.equal(GEMV(x[:rows].contiguous(), w), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_gemv
def test_gemv_refuses_what_it_cannot_read() -> None:
    assert GEMV is not None
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="float32"):
        GEMV(x.half(), w.half())
    with pytest.raises(ValueError, match="do not multiply"):
        GEMV(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="contiguous"):
        GEMV(x, torch.randn(8, 3).t())
    assert GEMV(torch.empty(0, 8), w).shape == (0, 3)
