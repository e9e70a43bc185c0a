"""The C float32 product over packed weights (kernels/cpu_gemm.c) against F.linear, its row
invariance, its packing, and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import kernel_cache_dir
from kernels import cpu_native

KERNELS = cpu_native.load(kernel_cache_dir())
GEMM = None if KERNELS is None else KERNELS.gemm
needs_gemm = pytest.mark.skipif(GEMM is None, reason="no C compiler on this machine")


@needs_gemm
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [
        (1, 576, 960),  # one row: two panels per tile
        (2, 64, 17),  # a pair whose second panel is partial
        (3, 7, 16),  # exactly one panel, odd k
        (4, 100, 33),  # the six-row tiles from 4 rows on, a partial last panel
        (6, 31, 48),
        (13, 48, 130),  # two full tiles and a remainder of one row
        (300, 20, 40),  # several row chunks
        (1, 5, 1),
        (5, 1, 3),
    ],
)
def test_gemm_equals_f_linear(rows: int, k: int, n: int) -> None:
    assert GEMM is not None
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    got = GEMM(x, GEMM.pack(w), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-4)


@needs_gemm
def test_the_chunks_of_a_long_prefill_cover_every_row() -> None:
    """Past CHUNK_BYTES of x per pass (512 KiB: 227 rows of 576) the rows go in chunks."""
    assert GEMM is not None
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(700, 576, generator=gen), torch.randn(40, 576, generator=gen)
    torch.testing.assert_close(GEMM(x, GEMM.pack(w), 40), F.linear(x, w), rtol=1e-4, atol=1e-3)


@needs_gemm
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    """Batch invariance by construction: every output is one chain of multiply-adds over k."""
    assert GEMM is not None
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(260, 200, generator=gen), torch.randn(301, 200, generator=gen)
    packed = GEMM.pack(w)
    alone = torch.cat([GEMM(x[i : i + 1].contiguous(), packed, 301) for i in range(260)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert GEMM.max_threads() == count  # torch's OpenMP runtime, shared
            for start, rows in ((0, 2), (0, 3), (0, 4), (5, 7), (0, 13), (17, 64), (0, 260)):
                got = GEMM(x[start : start + rows].contiguous(), packed, 301)
                assert torch.equal(got, alone[start : start + rows])
    finally:
        torch.set_num_threads(threads)


@needs_gemm
def test_packing_only_reorders_and_pads_with_zeros() -> None:
    from engine.layers.packed import PackedWeight

    assert GEMM is not None
    w = torch.randn(37, 9)
    weight = PackedWeight.pack(w, GEMM)
    assert weight.packed.shape == (3, 9, GEMM.panel) and weight.shape == (37, 9)
    assert torch.equal(weight.dequantize(), w)
    assert not weight.packed[2, :, 37 - 32 :].any()  # the last panel's 11 missing rows are zeros
    ids = torch.tensor([0, 36, 15, 16, 5])
    assert torch.equal(weight.rows(ids), w[ids])  # the lookups of a tied embedding table
    x = torch.randn(2, 3, 9)  # leading dimensions and a bias
    bias = torch.randn(37)
    torch.testing.assert_close(weight.matmul(x, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@needs_gemm
def test_gemm_refuses_what_it_cannot_read() -> None:
    assert GEMM is not None
    w = torch.randn(20, 8)
    packed = GEMM.pack(w)
    with pytest.raises(ValueError, match="float32"):
        GEMM(torch.randn(2, 8, dtype=torch.float64), packed, 20)
    with pytest.raises(ValueError, match="shapes"):
        GEMM(torch.randn(2, 9), packed, 20)  # k differs
    with pytest.raises(ValueError, match="shapes"):
        GEMM(torch.randn(2, 8), packed, 33)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="shapes"):
        GEMM(torch.randn(2, 8), packed, 16)  # a whole panel more than the outputs: not this weight
    with pytest.raises(ValueError, match="contiguous"):
        GEMM(torch.randn(8, 2).t(), packed, 20)
    with pytest.raises(ValueError, match="2-D float32"):
        GEMM.pack(torch.randn(4, 4, dtype=torch.float16))
    assert GEMM(torch.randn(0, 8), packed, 20).shape == (0, 20)
    assert torch.equal(GEMM(torch.randn(3, 0), GEMM.pack(torch.randn(5, 0)), 5), torch.zeros(3, 5))
