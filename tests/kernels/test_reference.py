"""The torch reference kernels against plain dense attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.paged_cases import dense_attention, paged_cache


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    return dense_attention(q, k, v, q_offset).to(q.dtype)


def _paged(contexts: list[int], block_size: int, kv_heads: int, dim: int, seed: int):  # type: ignore[no-untyped-def]
    c = paged_cache(contexts, block_size, kv_heads, dim, seed=seed)
    return c.k_cache, c.v_cache, c.block_tables, c.keys, c.values


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "contexts",
    [[1, 5, 17, 40, 63], [70, 3, 33, 1, 90, 16, 8, 41, 64, 2, 77, 5, 19, 50, 9, 31, 100, 4, 12]],
    ids=["one-group", "length-sorted-groups"],
)
def test_decode_attention_matches_dense(
    heads: int, kv_heads: int, block_size: int, contexts: list[int]
) -> None:
    k_cache, v_cache, table, ks, vs = _paged(contexts, block_size, kv_heads, 32, seed=heads + block_size)
    q = torch.randn(len(contexts), heads, 32)
    out = reference.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(contexts), 32**-0.5)
    for i, ctx in enumerate(contexts):
        expected = _dense_attention(q[i : i + 1], ks[i], vs[i], q_offset=ctx - 1)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_prefill_attention_over_cached_prefix_matches_dense(heads: int, kv_heads: int) -> None:
    # (cached prefix, new tokens): no prefix, a prefix not a multiple of the block size, a long one
    shapes = [(0, 9), (5, 3), (30, 1), (33, 20)]
    contexts = [p + n for p, n in shapes]
    k_cache, v_cache, table, ks, vs = _paged(contexts, 8, kv_heads, 16, seed=3)
    q_lens = [n for _, n in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, 16)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, cu, torch.tensor(contexts), table, 16**-0.5)
    for i, (prefix, _) in enumerate(shapes):
        expected = _dense_attention(q[cu[i] : cu[i + 1]], ks[i], vs[i], q_offset=prefix)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_store_kv_skips_padding_slots() -> None:
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    reference.store_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 1, 2)[5].eq(1).all() and k_cache.view(-1, 1, 2)[0].eq(1).all()
    assert int((k_cache != 0).sum()) == 4
    assert v_cache.view(-1, 1, 2)[5].eq(2).all()


def test_fused_add_rms_norm_and_silu_and_mul() -> None:
    x, res, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    normed, new_res = reference.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    h = x + res
    torch.testing.assert_close(normed, w * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    gu = torch.randn(2, 6)
    torch.testing.assert_close(reference.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :3]) * gu[:, 3:])
