"""The fused C decode operations (kernels/cpu_decode.c) against their torch references."""

from __future__ import annotations

import pytest
import torch

from engine.config import kernel_cache_dir
from kernels import cpu_decode, cpu_native, reference

KERNELS = cpu_native.load(kernel_cache_dir())
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler on this machine")


def _decode() -> cpu_native.CpuDecode:
    assert KERNELS is not None
    return KERNELS.decode


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 64), (8, 7)])
def test_norms_equal_the_reference(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    x, residual, weight = (
        torch.randn(rows, dim, generator=gen),
        torch.randn(rows, dim, generator=gen),
        torch.rand(dim),
    )
    kept = (x.clone(), residual.clone())
    torch.testing.assert_close(_decode().rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    out, summed = _decode().add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, want_out)
    assert torch.equal(summed, want_summed)
    assert torch.equal(x, kept[0]) and torch.equal(residual, kept[1])  # inputs untouched


def test_silu_and_mul_equals_the_reference() -> None:
    x = torch.randn(3, 2 * 1536) * 4
    torch.testing.assert_close(_decode().silu_and_mul(x), reference.silu_and_mul(x))
    x = torch.linspace(-30, 30, 2 * 4096).reshape(2, 4096)  # the vectorized exp across its range
    torch.testing.assert_close(_decode().silu_and_mul(x), reference.silu_and_mul(x), rtol=2e-6, atol=1e-6)
    # the vectorized exp at its edges (underflow, overflow) and a scalar tail (d = 37)
    edges = torch.tensor([-200.0, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 100.0])
    x = torch.cat((edges.repeat(4)[:37], torch.ones(37))).reshape(1, 74)
    torch.testing.assert_close(_decode().silu_and_mul(x), reference.silu_and_mul(x))
    with pytest.raises(ValueError, match="2 \\* d"):
        _decode().silu_and_mul(torch.randn(2, 5))


def _paged_case(
    heads: int, kv_heads: int, head_dim: int, lens: list[int], seed: int
) -> dict[str, torch.Tensor]:
    """Random caches and block tables for len(lens) sequences; each row is the last token of its context."""
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    width = max(-(-n // block_size) for n in lens) + 1  # one column of padding past the longest
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens]).to(torch.int32)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int64)
    slots = torch.tensor(
        [
            int(tables[i, p // block_size]) * block_size + p % block_size
            for i, p in enumerate(positions.tolist())
        ]
    )
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    return {
        "qkv": qkv,
        "k": k_cache,
        "v": v_cache,
        "tables": tables,
        "lens": torch.tensor(lens, dtype=torch.int32),
        "positions": positions,
        "slots": slots,
    }


def _reference_attention(
    case: dict[str, torch.Tensor],
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    rows = case["qkv"].shape[0]
    q, k, v = torch.split(case["qkv"], [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = reference.rotary_embedding(
        case["positions"], q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim), cos, sin
    )
    valid = case["slots"] >= 0
    reference.store_kv(k, v.reshape(rows, kv_heads, head_dim), case["k"], case["v"], case["slots"])
    out = torch.zeros(rows, heads, head_dim)
    if bool(valid.any()):
        out[valid] = reference.paged_decode_attention(
            q[valid], case["k"], case["v"], case["tables"][valid], case["lens"][valid], scale
        )
    return out.reshape(rows, heads * head_dim)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "lens"),
    [
        (9, 3, 64, [133]),
        (4, 2, 16, [1, 7, 16, 30]),
        (6, 1, 32, [5, 9, 40]),
        (2, 2, 16, [3]),
        (4, 4, 128, [12, 2]),
        (32, 2, 64, [70]),
    ],
)
def test_attention_equals_rotary_store_and_paged_attention(
    heads: int, kv_heads: int, head_dim: int, lens: list[int]
) -> None:
    """GQA, MQA and plain heads; contexts within one block and across several; the new K/V stored."""
    case = _paged_case(heads, kv_heads, head_dim, lens, seed=heads * 100 + head_dim)
    positions = 256
    angles = torch.arange(positions)[:, None] * torch.rand(head_dim // 2)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    scale = head_dim**-0.5
    fused = {name: t.clone() for name, t in case.items()}
    want = _reference_attention(case, heads, kv_heads, head_dim, cos, sin, scale)
    got = _decode().attention(
        fused["qkv"],
        (heads, kv_heads, head_dim),
        fused["positions"],
        (cos, sin),
        fused["k"],
        fused["v"],
        fused["slots"],
        fused["tables"],
        fused["lens"],
        scale,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused["k"], case["k"], rtol=1e-6, atol=1e-6)  # the rotated keys stored
    assert torch.equal(fused["v"], case["v"])


def _attend(
    case: dict[str, torch.Tensor],
    shape: tuple[int, int, int],
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    return _decode().attention(
        case["qkv"], shape, case["positions"], cos_sin, case["k"], case["v"], case["slots"], case["tables"],
        case["lens"], scale,
    )  # fmt: skip


def test_a_padding_row_stores_nothing_and_answers_zeros() -> None:
    case = _paged_case(4, 2, 16, [6, 9], seed=3)
    case["slots"][1] = -1
    cos, sin = torch.ones(16, 16), torch.zeros(16, 16)
    kept_k = case["k"].clone()
    out = _attend(case, (4, 2, 16), (cos, sin), 0.25)
    assert torch.equal(out[1], torch.zeros(64)) and out[0].abs().sum() > 0
    changed = (case["k"] != kept_k).any(dim=(2, 3))
    assert int(changed.sum()) == 1  # one slot written: row 0's
    case["positions"][0] = 16  # past the rotary tables (16 positions): never read out of bounds
    kept_k = case["k"].clone()
    out = _attend(case, (4, 2, 16), (cos, sin), 0.25)
    assert torch.equal(out, torch.zeros(2, 64)) and torch.equal(case["k"], kept_k)


def test_the_shapes_the_fused_attention_takes() -> None:
    assert (
        cpu_decode.supports(9, 3, 64) and cpu_decode.supports(32, 8, 128) and cpu_decode.supports(16, 1, 256)
    )
    assert not cpu_decode.supports(4, 2, 24)  # head_dim not in 16s: the torch path
    assert not cpu_decode.supports(34, 2, 64)  # 17 query heads per KV head
    assert not cpu_decode.supports(4, 4, 512)
    assert not cpu_decode.supports(6, 4, 64)


def test_attention_refuses_what_it_cannot_read() -> None:
    case = _paged_case(4, 2, 16, [6], seed=4)
    cos = sin = torch.zeros(16, 16)
    args = (
        case["positions"],
        (cos, sin),
        case["k"],
        case["v"],
        case["slots"],
        case["tables"],
        case["lens"],
        0.25,
    )
    with pytest.raises(ValueError, match="does not hold"):
        _decode().attention(case["qkv"][:, :-1].contiguous(), (4, 2, 16), *args)
    with pytest.raises(ValueError, match="float32"):
        _decode().attention(case["qkv"].double(), (4, 2, 16), *args)
    with pytest.raises(ValueError, match="block_tables"):
        bad = (*args[:5], case["tables"].long(), *args[6:])
        _decode().attention(case["qkv"], (4, 2, 16), *bad)
    with pytest.raises(ValueError, match="rotary tables"):
        _decode().attention(
            case["qkv"], (4, 2, 16), case["positions"], (torch.zeros(16, 8), torch.zeros(16, 8)), *args[2:]
        )


def test_a_prefills_rows_are_the_rows_decoded_one_by_one_bit_for_bit() -> None:
    """The batch-invariant backend sends every row here: 37 rows of one sequence (a prefill chunk
    after 5 cached tokens) beside another sequence's decode row, in one call, on 1 and 2 threads,
    give each row the bits it gets decoded alone at its position, and store the same keys."""
    heads, kv_heads, head_dim, block_size = 6, 2, 32, 4
    gen = torch.Generator().manual_seed(17)
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(40, generator=gen)[:12].to(torch.int32)
    other = torch.randperm(40, generator=gen)[:12].to(torch.int32)
    positions = torch.arange(5, 42)
    qkv = torch.randn(38, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.arange(64)[:, None] * torch.rand(head_dim // 2, generator=gen)[None, :]
    cos_sin = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())

    def slot(t: torch.Tensor, p: int) -> int:
        return int(t[p // block_size]) * block_size + p % block_size

    other_pos = 20  # the decode row of another sequence: it reads blocks the chunk never writes
    other = torch.tensor([b for b in other.tolist() if b not in table.tolist()][:6], dtype=torch.int32)
    rows_pos = torch.cat((positions, torch.tensor([other_pos])))
    tables = torch.stack([table] * 37 + [torch.cat((other, other))[:12]])
    slots = torch.tensor([slot(table, int(p)) for p in positions] + [slot(tables[37], other_pos)])
    shape, scale = (heads, kv_heads, head_dim), head_dim**-0.5
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            k, v = k_cache.clone(), v_cache.clone()
            out = _decode().attention(
                qkv, shape, rows_pos, cos_sin, k, v, slots, tables, (rows_pos + 1).to(torch.int32), scale
            )
            results.append((out, k))
        k, v = k_cache.clone(), v_cache.clone()
        alone = torch.cat(
            [
                _decode().attention(
                    qkv[i : i + 1].contiguous(), shape, rows_pos[i : i + 1], cos_sin, k, v, slots[i : i + 1],
                    tables[i : i + 1].contiguous(), (rows_pos[i : i + 1] + 1).to(torch.int32), scale,
                )
                for i in range(38)
            ]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for out, keys in results:
        assert torch.equal(out, alone) and torch.equal(keys, k)
