"""The C products over packed weights (kernels/cpu_gemm.c): float32 against F.linear, int8 and int4
against their exact references; their row invariance, their packing, and what they refuse."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine.config import kernel_cache_dir
from kernels import cpu_native
from kernels.cpu_gemm import INT4_MAX_GROUP, CpuGemm, reference_int4_gemm, reference_int8_gemm

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


def _rows_keep_their_bits(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Each window of x's rows, on 1 and 2 threads, gives the rows' bits when computed one by one."""
    assert GEMM is not None
    alone = torch.cat([product(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert GEMM.max_threads() == count  # torch's OpenMP runtime, shared
            for start, rows in ((0, 2), (0, 3), (0, 4), (5, 7), (0, 13), (17, 64), (0, x.shape[0])):
                assert torch.equal(product(x[start : start + rows].contiguous()), alone[start : start + rows])
    finally:
        torch.set_num_threads(threads)


@needs_gemm
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    """Batch invariance by construction: every output is one chain of multiply-adds over k."""
    assert GEMM is not None
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(260, 200, generator=gen), torch.randn(301, 200, generator=gen)
    _rows_keep_their_bits(GEMM.bind(GEMM.pack(w), 301), x)


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


def _int8_case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return x, codes, torch.rand(n, generator=gen) + 0.01


def _builds() -> list[str]:
    """The builds whose integer products the tests run: this CPU's, and where it has VNNI also one
    for AVX2 alone (madd + add instead of dpwssd, w8a8 on int16 lanes instead of dpbusd over quads:
    what a CPU without VNNI runs)."""
    return ["native", "haswell"] if GEMM is not None and GEMM.vnni else ["native"]


@pytest.fixture(scope="module", params=_builds())
def build_gemm(request: pytest.FixtureRequest) -> CpuGemm:
    march = request.param
    kernels = KERNELS if march == "native" else cpu_native.load(kernel_cache_dir(), march=march)
    if kernels is None:
        pytest.skip(f"no C kernels built for -march={march} here")
    return kernels.gemm


@needs_gemm
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [
        (1, 576, 960),  # one row: two panels per tile
        (2, 64, 17),  # a pair whose second panel is partial
        (3, 7, 16),  # odd k: the last pair padded with a zero
        (4, 100, 33),
        (13, 1537, 130),  # three chunks of 512 inputs, the last one short
        (300, 20, 40),  # several row chunks
        (1, 1, 1),
        (40, 1536, 576),
    ],
)
def test_int8_gemm_is_its_reference_bit_for_bit(build_gemm: CpuGemm, rows: int, k: int, n: int) -> None:
    x, codes, scales = _int8_case(rows, k, n, rows * 1000 + k + n)
    packed = build_gemm.pack_int8(codes)
    assert packed.shape == (-(-n // 16), -(-k // 2), 32)
    assert torch.equal(build_gemm.unpack_int8(packed, n, k), codes)
    got = build_gemm.int8(x, packed, build_gemm.pack_scales(scales), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, reference_int8_gemm(x, codes, scales))
    exact = x.double() @ (codes.double() * scales.double()[:, None]).T
    assert (got.double() - exact).norm() / exact.norm() < 1e-4  # int16 activations: ~3e-5


@needs_gemm
def test_int8_sums_of_the_largest_codes_do_not_overflow() -> None:
    """Every product at its largest (|x| at the row's maximum, codes -128) over 4,096 inputs: the
    int32 sums of 512 inputs stay below 2^31 and the total is exact."""
    assert GEMM is not None
    x = torch.full((2, 4096), 3.0)
    x[1] = -3.0
    codes = torch.full((16, 4096), -128, dtype=torch.int8)
    scales = torch.ones(16)
    got = GEMM.int8(x, GEMM.pack_int8(codes), GEMM.pack_scales(scales), 16)
    want = torch.tensor([-4096 * 128 * 3.0, 4096 * 128 * 3.0])[:, None].expand(2, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got, reference_int8_gemm(x, codes, scales))


@needs_gemm
def test_rows_of_tiny_values_keep_their_codes_in_range() -> None:
    """A scale max |x| / qmax below FLT_MIN would be subnormal (a few bits): x / scale passed 32767
    (the vector lanes clamped, the scalar tail wrapped and flipped the sign). The scale stays normal."""
    assert GEMM is not None
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (16, 9), generator=gen, dtype=torch.int8)
    scales = torch.rand(16, generator=gen) + 0.01
    for value in (1.2695e-38, 3.0e-35, 2.0e-34):
        x = torch.full((2, 9), value)
        x[1] = -value
        got = GEMM.int8(x, GEMM.pack_int8(codes), GEMM.pack_scales(scales), 16)
        assert torch.equal(got, reference_int8_gemm(x, codes, scales))
        exact = x.double() @ (codes.double() * scales.double()[:, None]).T
        # no wrapped code (a flipped sign); a row this close to zero keeps a few levels only
        assert ((got.double() - exact).abs() <= 0.1 * exact.abs()).all()


@needs_gemm
def test_an_int8_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    """Exact integer sums per chunk, added in chunk order: the same bits in any batch."""
    assert GEMM is not None
    x, codes, scales = _int8_case(200, 130, 301, 11)
    _rows_keep_their_bits(GEMM.bind_int8(GEMM.pack_int8(codes), GEMM.pack_scales(scales), 301, 130), x)


@needs_gemm
def test_an_int8_row_holding_a_nan_or_an_infinity_gives_nan_and_leaves_the_others() -> None:
    assert GEMM is not None
    x, codes, scales = _int8_case(4, 37, 20, 5)
    x[1, 36] = float("nan")  # in the scalar tail
    x[2, 3] = float("inf")  # in the vectorized part
    got = GEMM.int8(x, GEMM.pack_int8(codes), GEMM.pack_scales(scales), 20)
    assert got[1].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[[0, 3]], reference_int8_gemm(x[[0, 3]], codes, scales))
    zeros = GEMM.int8(torch.zeros(1, 37), GEMM.pack_int8(codes), GEMM.pack_scales(scales), 20)
    assert torch.equal(zeros, torch.zeros(1, 20))  # an all-zero row: scale clamped, codes zero


@needs_gemm
def test_int8_gemm_refuses_what_it_cannot_read() -> None:
    assert GEMM is not None
    codes = torch.randint(-127, 128, (20, 9), dtype=torch.int8)
    packed, scales = GEMM.pack_int8(codes), GEMM.pack_scales(torch.rand(20))
    with pytest.raises(ValueError, match="int8 panels"):
        GEMM.int8(torch.randn(2, 9), packed.float(), scales, 20)
    with pytest.raises(ValueError, match="scales"):
        GEMM.int8(torch.randn(2, 9), packed, scales[:16], 20)
    with pytest.raises(ValueError, match="shapes"):
        GEMM.int8(torch.randn(2, 11), packed, scales, 20)  # 6 pairs of inputs, the panels hold 5
    with pytest.raises(ValueError, match="float32 activations"):
        GEMM.int8(torch.randn(2, 9, dtype=torch.bfloat16), packed, scales, 20)
    product = GEMM.bind_int8(packed, scales, 20, 9)  # checked once; its calls check x alone
    with pytest.raises(ValueError, match="shapes"):
        product(torch.randn(2, 10))  # 10 inputs fill the 5 pairs, but the weight has 9
    with pytest.raises(ValueError, match="contiguous"):
        product(torch.randn(9, 2).t())
    assert torch.equal(product(x := torch.randn(2, 9)), reference_int8_gemm(x, codes, scales[:20]))
    with pytest.raises(ValueError, match="2-D int8"):
        GEMM.pack_int8(codes.float())
    with pytest.raises(ValueError, match="2-D float32"):
        GEMM.pack(codes)
    assert GEMM.int8(torch.randn(0, 9), packed, scales, 20).shape == (0, 20)
    empty = GEMM.pack_int8(torch.zeros(5, 0, dtype=torch.int8))
    got = GEMM.int8(torch.randn(3, 0), empty, GEMM.pack_scales(torch.rand(5)), 5)
    assert torch.equal(got, torch.zeros(3, 5))


def _int_mm_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w8a8 in torch: rows to int8 by their own maximum, torch._int_mm, then row and column scales."""
    row_scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    x_codes = torch.round(x / row_scale).to(torch.int8)
    return torch._int_mm(x_codes, codes.t().contiguous()).float().mul_(row_scale).mul_(scales)


@needs_gemm
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(1, 576, 960), (2, 64, 17), (3, 7, 16), (4, 101, 33), (13, 1537, 130), (300, 20, 40), (40, 1536, 576)],
)
def test_build_gemm_is_torch_int_mm_bit_for_bit(build_gemm: CpuGemm, rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=gen) * 3
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) + 0.01
    packed = build_gemm.pack_w8a8(codes)
    if build_gemm.vnni:  # quads of the codes + 128
        assert packed.shape == (-(-n // 16), -(-k // 4), 64) and packed.dtype == torch.uint8
    else:  # the int8 product's pairs
        assert torch.equal(packed, build_gemm.pack_int8(codes))
    got = build_gemm.bind_w8a8(packed, build_gemm.pack_scales(scales), n, k)(x)
    assert torch.equal(got, _int_mm_reference(x, codes, scales))


@needs_gemm
def test_w8a8_sums_as_large_as_they_may_grow_stay_exact(build_gemm: CpuGemm) -> None:
    """W8A8_MAX_K inputs with codes near +-127 on both sides: int32 sums near +-2^30, exact (no float
    steps between inputs: a float32 running sum past 2^24 would drop their low bits)."""
    from kernels.cpu_gemm import W8A8_MAX_K

    k = W8A8_MAX_K
    gen = torch.Generator().manual_seed(7)
    x = torch.ones(2, k)
    x[1, 1:] = torch.rand(k - 1, generator=gen) * 0.5 + 0.5  # codes 64..127
    codes = torch.randint(100, 128, (3, k), generator=gen, dtype=torch.int8)
    codes[1] = -codes[1] - 1  # -128..-101
    codes[2] = torch.randint(-128, 128, (k,), generator=gen, dtype=torch.int8)
    scales = torch.ones(3)
    got = build_gemm.bind_w8a8(build_gemm.pack_w8a8(codes), build_gemm.pack_scales(scales), 3, k)(x)
    want = _int_mm_reference(x, codes, scales)
    assert want[:, :2].abs().min() > 2**29 * (1 / 127)
    assert torch.equal(got, want)


@needs_gemm
def test_w8a8_rows_keep_their_bits_and_a_non_finite_row_gives_nan(build_gemm: CpuGemm) -> None:
    x, codes, scales = _int8_case(200, 130, 301, 13)
    codes = codes.clamp(min=-127)
    product = build_gemm.bind_w8a8(build_gemm.pack_w8a8(codes), build_gemm.pack_scales(scales), 301, 130)
    _rows_keep_their_bits(product, x)
    x[3, 129] = float("nan")
    x[4, 0] = float("-inf")
    got = product(x[:6].contiguous())
    assert got[3].isnan().all() and got[4].isnan().all()
    assert torch.equal(got[[0, 1, 2, 5]], _int_mm_reference(x[[0, 1, 2, 5]], codes, scales))


@needs_gemm
def test_build_gemm_refuses_what_it_cannot_run(build_gemm: CpuGemm) -> None:
    from kernels.cpu_gemm import W8A8_MAX_K

    codes = torch.randint(-127, 128, (20, 9), dtype=torch.int8)
    packed, scales = build_gemm.pack_w8a8(codes), build_gemm.pack_scales(torch.rand(20))
    with pytest.raises(ValueError, match="shapes"):
        build_gemm.bind_w8a8(packed, scales, 20, 13)  # one more line of inputs than the panels hold
    with pytest.raises(ValueError, match="panels and float32 scales"):  # the other build's layout
        build_gemm.bind_w8a8(packed.view(torch.int8 if build_gemm.vnni else torch.uint8), scales, 20, 9)
    with pytest.raises(ValueError, match="at most"):
        build_gemm.bind_w8a8(packed, scales, 20, W8A8_MAX_K + 1)  # its int32 sums could overflow
    product = build_gemm.bind_w8a8(packed, scales, 20, 9)
    with pytest.raises(ValueError, match="shapes"):
        product(torch.randn(2, 12))


def _int4_case(
    rows: int, k: int, n: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // group, generator=gen) * 0.01
    m = torch.randn(n, k // group, generator=gen) * 0.05
    return x, q, d, m


def _int4_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int) -> torch.Tensor:
    return q.double() * d.double().repeat_interleave(group, 1) + m.double().repeat_interleave(group, 1)


@needs_gemm
@pytest.mark.parametrize(
    ("rows", "k", "n", "group"),
    [
        (1, 576, 960, 32),  # the default model's decode step
        (2, 64, 17, 32),  # a partial last panel
        (7, 128, 33, 64),
        (13, 96, 130, 32),  # two full tiles and a remainder of one row
        (300, 64, 40, 32),  # several row chunks
        (3, 8, 16, 4),  # the smallest group
        (5, 1536, 20, 128),
        (40, 1536, 576, 32),
    ],
)
@pytest.mark.parametrize("half", [False, True])
def test_int4_gemm_is_its_reference_bit_for_bit(
    build_gemm: CpuGemm, rows: int, k: int, n: int, group: int, half: bool
) -> None:
    if half and not build_gemm.half_scales:
        pytest.skip("float16 scales need F16C")
    x, q, d, m = _int4_case(rows, k, n, group, rows * 1000 + k + n + group)
    if half:  # Q4_1's form: float16 scales and offsets, stored as such (5 bits a weight, not 6)
        d, m = d.half().float(), m.half().float()
    packed = build_gemm.pack_int4(q, d, m, group, half)
    line = 8 * group + (64 if half else 128)
    assert packed.shape == (-(-n // 16), k // group, line) and packed.dtype == torch.uint8
    back = build_gemm.unpack_int4(packed, n, group)
    assert torch.equal(back[0], q) and torch.equal(back[1], d) and torch.equal(back[2], m)
    got = build_gemm.bind_int4(packed, n, k, group)(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, reference_int4_gemm(x, q, d, m, group))
    exact = x.double() @ _int4_weight(q, d, m, group).T
    assert (got.double() - exact).norm() / exact.norm() < 1e-4  # int16 activations: ~3e-5


@needs_gemm
def test_int4_sums_of_the_largest_groups_do_not_overflow() -> None:
    """Every product at its largest (|x| at the row's maximum, q = 15) in groups of 4,096 inputs:
    one group's int32 sum, 4,096 x 15 x 32,767, stays below 2^31."""
    assert GEMM is not None
    group = INT4_MAX_GROUP
    x = torch.full((2, 2 * group), 3.0)
    x[1] = -3.0
    q = torch.full((16, 2 * group), 15, dtype=torch.uint8)
    d, m = torch.ones(16, 2), torch.full((16, 2), 0.5)
    got = GEMM.bind_int4(GEMM.pack_int4(q, d, m, group), 16, 2 * group, group)(x)
    want = torch.tensor([2 * group * 15.5 * 3.0, -2 * group * 15.5 * 3.0])[:, None].expand(2, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got, reference_int4_gemm(x, q, d, m, group))


@needs_gemm
def test_an_int4_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    assert GEMM is not None
    x, q, d, m = _int4_case(200, 128, 301, 32, 13)
    _rows_keep_their_bits(GEMM.bind_int4(GEMM.pack_int4(q, d, m, 32), 301, 128, 32), x)
    if GEMM.half_scales:
        d, m = d.half().float(), m.half().float()
        _rows_keep_their_bits(GEMM.bind_int4(GEMM.pack_int4(q, d, m, 32, half=True), 301, 128, 32), x)


@needs_gemm
def test_an_int4_row_holding_a_nan_or_an_infinity_gives_nan_and_leaves_the_others() -> None:
    assert GEMM is not None
    x, q, d, m = _int4_case(4, 64, 20, 32, 5)
    x[1, 63] = float("nan")
    x[2, 3] = float("-inf")
    product = GEMM.bind_int4(GEMM.pack_int4(q, d, m, 32), 20, 64, 32)
    got = product(x)
    assert got[1].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[[0, 3]], reference_int4_gemm(x[[0, 3]], q, d, m, 32))
    assert torch.equal(product(torch.zeros(1, 64)), torch.zeros(1, 20))


@needs_gemm
def test_int4_gemm_refuses_what_it_cannot_read() -> None:
    assert GEMM is not None
    q, d, m = torch.randint(0, 16, (20, 64), dtype=torch.uint8), torch.rand(20, 2), torch.rand(20, 2)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        GEMM.pack_int4(q + 16, d, m, 32)
    with pytest.raises(ValueError, match="groups"):
        GEMM.pack_int4(q, d, m, 48)  # 64 inputs are not groups of 48
    with pytest.raises(ValueError, match="groups"):
        GEMM.pack_int4(q[:, :60], torch.rand(20, 6), torch.rand(20, 6), 10)  # not a multiple of 4
    with pytest.raises(ValueError, match="scales"):
        GEMM.pack_int4(q, d[:, :1], m, 32)
    with pytest.raises(ValueError, match="integer"):
        GEMM.pack_int4(q.float(), d, m, 32)
    with pytest.raises(ValueError, match="hold d and m exactly"):
        GEMM.pack_int4(q, d, m, 32, half=True)  # float32 scales that float16 would round
    with pytest.raises(ValueError, match="hold d and m exactly"):
        GEMM.pack_int4(q, d.half().float(), torch.full((20, 2), 1e6), 32, half=True)  # past float16's range
    packed = GEMM.pack_int4(q, d, m, 32)
    with pytest.raises(ValueError, match="uint8"):
        GEMM.bind_int4(packed.view(torch.int8), 20, 64, 32)
    with pytest.raises(ValueError, match="shapes"):
        GEMM.bind_int4(packed, 20, 96, 32)  # three groups asked, two packed
    with pytest.raises(ValueError, match="shapes"):
        GEMM.bind_int4(packed, 20, 64, 16)  # the packed groups are of 32
    with pytest.raises(ValueError, match="shapes"):
        GEMM.bind_int4(packed, 40, 64, 32)  # two panels' outputs, one packed
    product = GEMM.bind_int4(packed, 20, 64, 32)
    with pytest.raises(ValueError, match="shapes"):
        product(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32 activations"):
        product(torch.randn(2, 64, dtype=torch.float16))
    assert product(torch.randn(0, 64)).shape == (0, 20)
