"""The Triton prefill / extend attention against dense attention and the torch reference.

Sequences mix fresh prompts (no cached prefix), chunked-prefill continuations and long cached
prefixes; lengths are off the block size and blocks are shuffled.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.prefill_attention import paged_prefill_attention
from tests.kernels.devices import CUDA, DEVICE
from tests.kernels.paged_cases import dense_attention, paged_cache, past_32_bits

GQA = [(4, 4), (8, 2), (7, 1)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# every GQA ratio with both head dims and both block sizes, without the full product
FLOAT32_CASES = [(h, kvh, 64, 16) for h, kvh in GQA] + [(h, kvh, 128, 32) for h, kvh in GQA]
FLOAT32_CASES += [(8, 2, 64, 32), (7, 1, 128, 16)]
# (cached prefix, new tokens)
SHAPES = [(0, 37), (5, 3), (130, 1), (70, 90)]


def _check_prefill(
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    first_block: int = 0,
) -> None:
    contexts = [p + n for p, n in shapes]
    c = paged_cache(
        contexts,
        block_size,
        kv_heads,
        dim,
        seed=heads + dim + block_size,
        dtype=dtype,
        first_block=first_block,
        device=DEVICE,
    )
    q_lens = [n for _, n in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, dim, device=DEVICE).to(dtype)
    out = paged_prefill_attention(q, c.k_cache, c.v_cache, cu, lens, c.block_tables, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    for i, (prefix, _) in enumerate(shapes):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        expected = dense_attention(q[rows], c.keys[i], c.values[i], q_offset=prefix)
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)
    if first_block == 0:
        ref = reference.paged_prefill_attention(
            q.float(), c.k_cache.float(), c.v_cache.float(), cu, lens, c.block_tables, dim**-0.5
        )
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), FLOAT32_CASES)
def test_prefill_matches_reference_in_float32(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    _check_prefill(heads, kv_heads, dim, block_size, SHAPES, torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_prefill_matches_reference_in_float16(heads: int, kv_heads: int) -> None:
    _check_prefill(heads, kv_heads, 64, 16, SHAPES, torch.float16)


def test_long_cached_prefix_with_a_short_extension() -> None:
    _check_prefill(8, 2, 64, 16, [(1000, 5), (0, 1)], torch.float32)


def test_block_offsets_past_32_bits_are_addressed_correctly() -> None:
    _check_prefill(4, 1, 64, 16, [(20, 13), (0, 9)], torch.float16, first_block=past_32_bits(16, 1, 64))


def test_launcher_rejects_bad_arguments() -> None:
    c = paged_cache([10], 16, 2, 64, seed=2, device=DEVICE)
    q = torch.randn(10, 4, 64, device=DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        paged_prefill_attention(q, c.k_cache, c.v_cache, cu[:1], lens, c.block_tables, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must have dtype"):
        paged_prefill_attention(q, c.k_cache, c.v_cache, cu.long(), lens, c.block_tables, 0.1)
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        paged_prefill_attention(q[0], c.k_cache, c.v_cache, cu, lens, c.block_tables, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        odd = torch.zeros(2, 12, 2, 64, device=DEVICE)
        paged_prefill_attention(q, odd, odd, cu, lens, c.block_tables, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_on_gpu_in_half_precision(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    _check_prefill(heads, kv_heads, dim, 16, [*SHAPES, (3000, 700)], dtype)
    _check_prefill(
        heads, kv_heads, dim, 32, [(20, 13), (0, 300)], dtype, first_block=past_32_bits(32, kv_heads, dim)
    )
