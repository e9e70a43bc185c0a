"""Triton silu_and_mul against kernels.reference (CPU interpreter, or CUDA when present)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import reference
from kernels.activation import silu_and_mul
from tests.kernels.devices import DEVICE, TARGETS

_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # atol = rtol


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual, expected, atol=_TOL[dtype], rtol=_TOL[dtype])


def _randn(*shape: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return (3 * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize(
    "shape",
    [(1, 2 * 96), (7, 2 * 1536), (2, 3, 2 * 64)],
    ids=["one-token", "smollm2-intermediate", "3d"],
)
def test_silu_and_mul_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _randn(*shape, device=device, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype and out.is_contiguous()
    _assert_close(out, reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
def test_silu_and_mul_reads_rows_of_a_wider_tensor(device: str, dtype: torch.dtype) -> None:
    x = _randn(5, 300, device=device, dtype=dtype)[:, 10 : 10 + 2 * 96]  # rows 300 apart
    _assert_close(silu_and_mul(x), reference.silu_and_mul(x), dtype)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, device=DEVICE, dtype=dtype)


BAD_SILU_AND_MUL: dict[str, tuple[Callable[[], object], str]] = {
    "odd last dim": (lambda: silu_and_mul(_x(2, 7)), "must be even"),
    "integer x": (lambda: silu_and_mul(_x(2, 8, dtype=torch.int64)), "x must have dtype"),
    "strided last dim": (lambda: silu_and_mul(_x(8, 2).t()), "contiguous in its last"),
    "rows not one stride apart": (lambda: silu_and_mul(_x(4, 3, 8).transpose(0, 1)), "uniform stride"),
    "scalar x": (lambda: silu_and_mul(_x()), "at least one dimension"),
}


@pytest.mark.parametrize("case", BAD_SILU_AND_MUL.keys())
def test_launcher_rejects_bad_arguments(case: str) -> None:
    call, message = BAD_SILU_AND_MUL[case]
    with pytest.raises(ValueError, match=message):
        call()
