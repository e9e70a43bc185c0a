"""Quantized KV caches (int8, fp8 e4m3 codes with a float16 scale per token and head): the format's
error bounds, and the Triton store / decode / prefill kernels against the torch reference.

Without CUDA the kernels run through Triton's interpreter, in float32 and float16.
"""

from __future__ import annotations

import pytest
import torch

from kernels import kv_quant, reference
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv
from tests.kernels.devices import CUDA, DEVICE
from tests.kernels.paged_cases import PagedCache, dense_attention, paged_cache

CODES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
KERNEL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# attention over quantized K/V against float64 attention over the original values (atol, rtol):
# e4m3 rounds each value by up to 2**-4 of itself, and errors in K move the softmax weights
QUALITY_TOL = {torch.int8: (0.03, 0.0), torch.float8_e4m3fn: (0.15, 0.0)}


def _hard_values(n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """Rows spanning many magnitudes: tiny rows (scales at the floor), rows with an outlier, values
    that round across a power of two, and an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=gen) * torch.logspace(-6, 3, n)[:, None, None]
    x[0] = 0.0
    x[1, 0, 5] = 900.0
    x[2, :, :8] = torch.tensor([1.97, -1.97, 3.9, 7.99, 0.0155, -0.015, 255.5, 1e-4])
    return x


@pytest.mark.parametrize("code", CODES)
def test_each_value_comes_back_within_half_a_code_step(code: torch.dtype) -> None:
    x = _hard_values(64, 3, 64, seed=1)
    codes, scales = kv_quant.quantize(x, code)
    assert codes.dtype == code and scales.dtype == torch.float16 and scales.shape == x.shape[:2]
    assert bool((scales.float() >= kv_quant.MIN_SCALE).all())
    back = kv_quant.dequantize(codes, scales, torch.float32)
    s = scales.float()[..., None]
    if code == torch.int8:
        assert int(codes.abs().max()) <= 127
        # half a step, plus what a float16 scale rounded down can clip off the largest value
        bound = s / 2 + x.abs().amax(-1, keepdim=True) * 2**-11
    else:  # e4m3 keeps 3 mantissa bits: half a unit in the last place, or the subnormal step
        bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) + x.abs().amax(-1, keepdim=True) * 2**-11
    assert bool(((back - x).abs() <= bound + 1e-12).all())
    assert torch.equal(back[0], torch.zeros(3, 64))  # a zero row stays zero


def _quantized(c: PagedCache, code: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The whole pool as (k codes, v codes, k scales, v scales)."""
    k_codes, k_scales = kv_quant.quantize(c.k_cache, code)
    v_codes, v_scales = kv_quant.quantize(c.v_cache, code)
    return k_codes, v_codes, k_scales, v_scales


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_the_reference_codes_and_scales(code: torch.dtype, dtype: torch.dtype) -> None:
    num_blocks, block_size, kv_heads, dim = 10, 16, 3, 64
    key = _hard_values(70, kv_heads, dim, seed=2).to(dtype).to(DEVICE)
    value = (_hard_values(70, kv_heads, dim, seed=3) * -0.5).to(dtype).to(DEVICE)
    perm = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(4))
    slots = perm[:70].to(DEVICE)
    slots[[5, 33]] = -1  # padding
    shape = (num_blocks, block_size, kv_heads, dim)
    pools = [torch.zeros(shape, dtype=code, device=DEVICE) for _ in range(4)]
    scales = [torch.ones(shape[:3], dtype=torch.float16, device=DEVICE) for _ in range(4)]
    store_kv(key, value, pools[0], pools[1], slots, scales[0], scales[1])
    reference.store_kv(key, value, pools[2], pools[3], slots, scales[2], scales[3])
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(kv_quant.storage_view(got), kv_quant.storage_view(want))
    assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])
    written = scales[0].view(-1, kv_heads).ne(1).any(-1)
    assert int(written.sum()) <= 68 and not bool(written[perm[[5, 33]]].any())  # padding stored nothing


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_codes_matches_the_reference(
    code: torch.dtype, dtype: torch.dtype, num_splits: int
) -> None:
    heads, kv_heads, dim, block_size, contexts = 8, 2, 64, 16, [1, 17, 50, 200]
    c = paged_cache(contexts, block_size, kv_heads, dim, seed=5, dtype=dtype, device=DEVICE)
    kc, vc, ks, vs = _quantized(c, code)
    q = torch.randn(len(contexts), heads, dim, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q, kc, vc, c.block_tables, lens, dim**-0.5, num_splits=num_splits, k_scale=ks, v_scale=vs
    )
    ref = reference.paged_decode_attention(q, kc, vc, c.block_tables, lens, dim**-0.5, k_scale=ks, v_scale=vs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])
    for i, ctx in enumerate(contexts):  # and close to attention over the unquantized values
        expected = dense_attention(q[i : i + 1], c.keys[i], c.values[i], q_offset=ctx - 1)
        atol, rtol = QUALITY_TOL[code]
        got = out[i : i + 1].double()
        torch.testing.assert_close(got, expected, atol=atol + KERNEL_TOL[dtype], rtol=rtol)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_codes_matches_the_reference(code: torch.dtype, dtype: torch.dtype) -> None:
    heads, kv_heads, dim, block_size = 6, 2, 64, 16
    contexts, new = [40, 9, 130], [40, 3, 57]  # a fresh prompt, a short extension, a chunk after a prefix
    c = paged_cache(contexts, block_size, kv_heads, dim, seed=6, dtype=dtype, device=DEVICE)
    kc, vc, ks, vs = _quantized(c, code)
    q = torch.randn(sum(new), heads, dim, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    cu = torch.tensor([0, 40, 43, 100], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    args = (q, kc, vc, cu, lens, c.block_tables, dim**-0.5)
    out = paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    ref = reference.paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref.float(), atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])
    start = 0
    for b, (ctx, n) in enumerate(zip(contexts, new, strict=True)):
        expected = dense_attention(q[start : start + n], c.keys[b], c.values[b], q_offset=ctx - n)
        atol, rtol = QUALITY_TOL[code]
        got = out[start : start + n].double()
        torch.testing.assert_close(got, expected, atol=atol + KERNEL_TOL[dtype], rtol=rtol)
        start += n


def test_reference_over_codes_is_attention_over_the_dequantized_values() -> None:
    c = paged_cache([33, 70], 16, 2, 32, seed=7)
    kc, vc, ks, vs = _quantized(c, torch.int8)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(11))
    lens = torch.tensor([33, 70], dtype=torch.int32)
    quantized = reference.paged_decode_attention(q, kc, vc, c.block_tables, lens, 0.2, k_scale=ks, v_scale=vs)
    plain = reference.paged_decode_attention(
        q,
        kv_quant.dequantize(kc, ks, torch.float32),
        kv_quant.dequantize(vc, vs, torch.float32),
        c.block_tables,
        lens,
        0.2,
    )
    assert torch.equal(quantized, plain)


def test_kernels_refuse_codes_without_scales_and_scales_without_codes() -> None:
    c = paged_cache([20], 16, 2, 32, seed=8, device=DEVICE)
    kc, vc, ks, vs = _quantized(c, torch.int8)
    q = torch.randn(1, 4, 32, device=DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_decode_attention(q, kc, vc, c.block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="takes no scales"):
        paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables, lens, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale must have dtype"):
        paged_decode_attention(q, kc, vc, c.block_tables, lens, 0.1, k_scale=ks.float(), v_scale=vs)
    with pytest.raises(ValueError, match="v_scale must have shape"):
        paged_decode_attention(q, kc, vc, c.block_tables, lens, 0.1, k_scale=ks, v_scale=vs[:, :8])
    key = torch.randn(3, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(key, key, kc, vc, torch.arange(3, device=DEVICE))
