"""The Triton paged decode attention (flash-decoding) against the torch reference and dense attention.

Without CUDA these run through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET),
in float32 and float16 only: the interpreter computes bfloat16 arithmetic wrongly.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.paged_attention import paged_decode_attention
from kernels.split_kv import choose_num_splits
from tests.kernels.devices import CUDA, DEVICE
from tests.kernels.paged_cases import dense_attention, paged_cache, past_32_bits

GQA = [(4, 4), (8, 2), (7, 1)]  # (query heads, KV heads): ratios 1, 4 and 7
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# every GQA ratio with both head dims and both block sizes, without the full product
FLOAT32_CASES = [(h, kvh, 64, 16) for h, kvh in GQA] + [(h, kvh, 128, 32) for h, kvh in GQA]
FLOAT32_CASES += [(8, 2, 64, 32), (7, 1, 128, 16)]


def _check_decode(
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    contexts: list[int],
    dtype: torch.dtype,
    num_splits: int | None,
    first_block: int = 0,
) -> None:
    c = paged_cache(
        contexts,
        block_size,
        kv_heads,
        dim,
        seed=heads * dim + block_size,
        dtype=dtype,
        first_block=first_block,
        device=DEVICE,
    )
    q = torch.randn(len(contexts), heads, dim, device=DEVICE).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q, c.k_cache, c.v_cache, c.block_tables, lens, dim**-0.5, num_splits=num_splits
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    for i, ctx in enumerate(contexts):
        expected = dense_attention(q[i : i + 1], c.keys[i], c.values[i], q_offset=ctx - 1)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=tol, rtol=tol)
    if first_block == 0:  # the reference agrees too (it is the CPU path the engine compares with)
        ref = reference.paged_decode_attention(
            q.float(), c.k_cache.float(), c.v_cache.float(), c.block_tables, lens, dim**-0.5
        )
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), FLOAT32_CASES)
def test_decode_matches_reference_in_float32(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    # lengths off the block size, one token, and a context spanning many shuffled blocks
    _check_decode(heads, kv_heads, dim, block_size, [1, 17, 50, 300], torch.float32, num_splits=None)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_in_float16(heads: int, kv_heads: int, num_splits: int) -> None:
    _check_decode(heads, kv_heads, 64, 16, [5, 33, 200], torch.float16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 5, 8])
def test_split_kv_merge_is_exact_for_long_and_short_contexts(num_splits: int) -> None:
    # some splits of the short sequences are empty: their partials must weigh nothing
    _check_decode(8, 2, 64, 16, [3, 64, 700], torch.float32, num_splits=num_splits)


def test_block_offsets_past_32_bits_are_addressed_correctly() -> None:
    # block stride 16 * 1 * 64 = 1024 elements: block ids from 2**21 put offsets past 2**31
    _check_decode(4, 1, 64, 16, [40, 7], torch.float16, num_splits=2, first_block=past_32_bits(16, 1, 64))


def test_padding_rows_with_no_context_give_zeros() -> None:
    c = paged_cache([20, 9], 16, 2, 64, seed=1, device=DEVICE)
    q = torch.randn(3, 4, 64, device=DEVICE)
    tables = torch.cat((c.block_tables, c.block_tables[:1]))
    lens = torch.tensor([20, 9, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = paged_decode_attention(q, c.k_cache, c.v_cache, tables, lens, 0.125, num_splits=splits)
        assert out[2].eq(0).all() and out[:2].isfinite().all()


def test_launcher_rejects_bad_arguments() -> None:
    c = paged_cache([10], 16, 2, 64, seed=2, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="context_lens must have dtype"):
        paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables, lens.long(), 0.1)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="does not fit a cache"):
        paged_decode_attention(
            torch.randn(1, 3, 64, device=DEVICE), c.k_cache, c.v_cache, c.block_tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.half(), c.k_cache, c.v_cache, c.block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), c.k_cache, c.v_cache, c.block_tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables, lens, 0.1, num_splits=0)


def test_split_count_keeps_slices_of_at_least_256_tokens_and_caps_the_interpreter() -> None:
    cpu = torch.device("cpu")
    assert choose_num_splits(4, 2, 100, cpu) == 1
    assert choose_num_splits(4, 2, 256, cpu) == 1
    assert choose_num_splits(4, 2, 257, cpu) == 2
    assert choose_num_splits(4, 2, 100_000, cpu) == 4  # the interpreter pays per program


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_on_gpu_in_half_precision(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    _check_decode(heads, kv_heads, dim, 16, [1, 17, 500, 4100], dtype, num_splits=None)
    _check_decode(
        heads, kv_heads, dim, 32, [3, 999], dtype, num_splits=7, first_block=past_32_bits(32, kv_heads, dim)
    )
