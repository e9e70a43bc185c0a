"""The Triton weight-only quantized matmuls (int4 groups, int8 rows) against their torch twins.

Without CUDA they run through Triton's interpreter in float32 and float16.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference_quant
from kernels.quant_matmul import int4_matmul, int8_matmul
from tests.kernels.devices import TARGETS

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _int4_case(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    groups = k // group
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.002
    offsets = -torch.randint(0, 16, (groups, n), generator=gen).float() * scales
    return reference_quant.pack_int4(q), scales, offsets, q


def test_the_int4_packing_round_trips_and_puts_k_in_the_low_bits_first() -> None:
    q = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(0))
    packed = reference_quant.pack_int4(q)
    assert packed.shape == (5, 24) and packed.dtype == torch.int32
    assert torch.equal(reference_quant.unpack_int4(packed), q.to(torch.int32))
    assert int(packed[0, 3]) & 0xF == int(q[3, 0]) and (int(packed[0, 3]) >> 4) & 0xF == int(q[3, 1])


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 96, 256, 128), (5, 64, 128, 32), (33, 160, 512, 64)])
def test_int4_matmul_matches_the_reference(
    device: str, dtype: torch.dtype, m: int, n: int, k: int, group: int
) -> None:
    qweight, scales, offsets, _ = _int4_case(n, k, group, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    args = (qweight.to(device), scales.to(device), offsets.to(device), group)
    out = int4_matmul(x, *args)
    ref = reference_quant.int4_matmul(x, *args)
    assert out.dtype == dtype and out.shape == (m, n)
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 200), (7, 64, 128), (40, 130, 256)])
def test_int8_matmul_matches_the_reference(device: str, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n)
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    out = int8_matmul(x.view(m, 1, k), qweight.to(device), scales.to(device))  # leading dims kept
    ref = reference_quant.int8_matmul(x, qweight.to(device), scales.to(device))
    assert out.shape == (m, 1, n)
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.view(m, n).float(), ref.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize(("device", "dtype"), TARGETS[:1])
def test_launchers_refuse_layouts_they_cannot_read(device: str, dtype: torch.dtype) -> None:
    qweight, scales, offsets, _ = _int4_case(32, 64, 32, seed=3)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        int4_matmul(x, qweight, scales, offsets, 24)
    with pytest.raises(ValueError, match="scales must have shape"):
        int4_matmul(x, qweight, scales[:1], offsets, 32)
    with pytest.raises(ValueError, match="x's last dimension"):
        int4_matmul(torch.randn(2, 60), qweight, scales, offsets, 32)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        int8_matmul(x, qweight, torch.ones(32))
