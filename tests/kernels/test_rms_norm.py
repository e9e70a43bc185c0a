"""Triton RMSNorm kernels against kernels.reference (CPU interpreter, or CUDA when present)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import reference
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from tests.kernels.devices import DEVICE, TARGETS

EPS = 1e-6


_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # atol = rtol


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual, expected, atol=_TOL[dtype], rtol=_TOL[dtype])


def _randn(*shape: int, device: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _weight(hidden: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hidden)
    return (0.5 + torch.rand(hidden, generator=gen)).to(device=device, dtype=dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize("shape", [(1, 96), (7, 576), (2, 3, 64)], ids=["one-token", "smollm2", "3d"])
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _randn(*shape, device=device, dtype=dtype)
    w = _weight(shape[-1], device, dtype)
    before = x.clone()
    out = rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    _assert_close(out, reference.rms_norm(x, w, EPS), dtype)
    assert torch.equal(x, before)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rms_norm_normalises_qk_heads_in_views_of_a_fused_qkv(
    device: str, dtype: torch.dtype, head_dim: int, num_tokens: int
) -> None:
    heads, kv_heads = 9, 3  # Qwen3 q/k norm: row stride (q + 2 kv) * head_dim, not hidden
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    w = _weight(head_dim, device, dtype)
    for view in (q, k):
        _assert_close(rms_norm(view, w, EPS), reference.rms_norm(view, w, EPS), dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize("shape", [(1, 96), (6, 576)], ids=["one-token", "smollm2"])
def test_fused_add_rms_norm_matches_reference_and_updates_residual_in_place(
    device: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    x = _randn(*shape, device=device, dtype=dtype, seed=1)
    residual = _randn(*shape, device=device, dtype=dtype, seed=2)
    w = _weight(shape[-1], device, dtype)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, w, EPS)
    out, new_residual = fused_add_rms_norm(x, residual, w, EPS)
    assert new_residual is residual
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # both add in dtype
    _assert_close(out, expected_out, dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
def test_fused_add_rms_norm_on_strided_rows(device: str, dtype: torch.dtype) -> None:
    x = _randn(4, 2, 200, device=device, dtype=dtype, seed=3)[..., :96]  # rows 200 apart, two levels
    residual = _randn(8, 150, device=device, dtype=dtype, seed=4)[:, 10:106].view(4, 2, 96)
    w = _weight(96, device, dtype)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, w, EPS)
    out, _ = fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    _assert_close(out, expected_out, dtype)


def test_rms_norm_promotes_like_torch_when_weight_is_float32() -> None:
    x = _randn(3, 96, device=DEVICE, dtype=torch.float16)
    w = _weight(96, DEVICE, torch.float32)
    out = rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.rms_norm(x, w, EPS), atol=1e-5, rtol=1e-5)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, device=DEVICE, dtype=dtype)


BAD_RMS_NORM: dict[str, tuple[Callable[[], object], str]] = {
    "integer x": (lambda: rms_norm(_x(2, 8, dtype=torch.int32), _x(8), EPS), "x must have dtype"),
    "weight of the wrong size": (lambda: rms_norm(_x(2, 8), _x(6), EPS), "weight must have shape"),
    "2-d weight": (lambda: rms_norm(_x(2, 8), _x(1, 8), EPS), "weight must have 1 dimensions"),
    "strided last dim": (lambda: rms_norm(_x(8, 2).t(), _x(8), EPS), "contiguous in its last"),
    "rows needing three strides": (
        lambda: rms_norm(_x(3, 4, 5, 8).transpose(0, 1)[:, :, :4], _x(8), EPS),
        "two strides",
    ),
    "scalar x": (lambda: rms_norm(_x(), _x(1), EPS), "at least one dimension"),
    "residual of another dtype": (
        lambda: fused_add_rms_norm(_x(2, 8), _x(2, 8, dtype=torch.float16), _x(8), EPS),
        "residual must have dtype",
    ),
    "residual of another shape": (
        lambda: fused_add_rms_norm(_x(2, 8), _x(3, 8), _x(8), EPS),
        "residual must have shape",
    ),
    "expanded residual": (
        lambda: fused_add_rms_norm(_x(2, 8), _x(1, 8).expand(2, 8), _x(8), EPS),
        "must not be expanded",
    ),
}


@pytest.mark.parametrize("case", BAD_RMS_NORM.keys())
def test_launchers_reject_bad_arguments(case: str) -> None:
    call, message = BAD_RMS_NORM[case]
    with pytest.raises(ValueError, match=message):
        call()
