"""The decoder stack in one C call (kernels/cpu_stack.c) against the same kernels called layer by layer."""

from __future__ import annotations

import pytest
import torch

from engine.config import kernel_cache_dir
from kernels import cpu_native
from kernels.cpu_gemm import PanelProduct
from kernels.cpu_stack import StackLayer, StackShape

KERNELS = cpu_native.load(kernel_cache_dir())
pytestmark = pytest.mark.skipif(
    KERNELS is None or not KERNELS.gemm.vectorized, reason="the C products build vectorized with AVX2 and FMA"
)

SHAPE = StackShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, eps=1e-5, scale=0.25)
BLOCK, BLOCKS = 4, 24


def _kernels() -> cpu_native.CpuKernels:
    assert KERNELS is not None
    return KERNELS


def _product(kind: str, n: int, k: int, gen: torch.Generator) -> PanelProduct:
    gemm = _kernels().gemm
    if kind == "float32":
        return gemm.bind(gemm.pack(torch.randn(n, k, generator=gen) / k**0.5), n)
    if kind == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = gemm.pack_scales(torch.rand(n, generator=gen) / (127 * k**0.5))
        return gemm.bind_int8(gemm.pack_int8(codes), scales, n, k)
    group = 16
    q = torch.randint(0, 16, (n, k), generator=gen)
    d = torch.rand(n, k // group, generator=gen) / (8 * k**0.5)
    half = kind == "int4-half"  # Q4_1's float16 scales and offsets
    if half:
        d = d.half().float()
    m = -8 * d
    return gemm.bind_int4(gemm.pack_int4(q, d, m, group, half), n, k, group)


def _layers(kind: str, count: int, bias: bool, seed: int) -> list[StackLayer]:
    gen = torch.Generator().manual_seed(seed)
    s = SHAPE
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layers = []
    for _ in range(count):
        layers.append(
            StackLayer(
                input_norm=torch.rand(s.hidden, generator=gen) + 0.5,
                post_norm=torch.rand(s.hidden, generator=gen) + 0.5,
                qkv=_product(kind, q_size + 2 * kv_size, s.hidden, gen),
                qkv_bias=torch.randn(q_size + 2 * kv_size, generator=gen) if bias else None,
                o=_product(kind, s.hidden, q_size, gen),
                gate_up=_product(kind, 2 * s.intermediate, s.hidden, gen),
                down=_product(kind, s.hidden, s.intermediate, gen),
                k_cache=torch.randn(BLOCKS, BLOCK, s.kv_heads, s.head_dim, generator=gen),
                v_cache=torch.randn(BLOCKS, BLOCK, s.kv_heads, s.head_dim, generator=gen),
            )
        )
    return layers


def _rotary() -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(128).float()[:, None] * (0.5 ** torch.arange(SHAPE.head_dim // 2).float())
    angles = torch.cat((angles, angles), dim=1)
    return angles.cos().contiguous(), angles.sin().contiguous()


def _layered(
    layers: list[StackLayer],
    final_norm: torch.Tensor,
    h: torch.Tensor,
    step: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The model's forward as engine/models/llama.py runs it on the C kernels, call by call."""
    decode = _kernels().decode
    s = SHAPE
    cos_sin = _rotary()
    residual = h
    x = decode.rms_norm(h, layers[0].input_norm, s.eps)
    for i, layer in enumerate(layers):
        if i:
            x, residual = decode.add_rms_norm(h, residual, layer.input_norm, s.eps)
        qkv = layer.qkv(x)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        shape = (s.heads, s.kv_heads, s.head_dim)
        attention = decode.bind_attention(shape, cos_sin, layer.k_cache, layer.v_cache, s.scale)
        out = layer.o(attention(qkv, *step))
        x, residual = decode.add_rms_norm(out, residual, layer.post_norm, s.eps)
        h = layer.down(decode.silu_and_mul(layer.gate_up(x)))
    return decode.add_rms_norm(h, residual, final_norm, s.eps)[0]


def _step(lens: list[int], rows_per_seq: list[int], first: int = 0) -> tuple[torch.Tensor, ...]:
    """positions, slots, tables, context lengths of a step: each sequence's last `rows` positions
    (sequence `first + i` with the i-th length: the same blocks whatever the step)."""
    positions, slots, tables, contexts = [], [], [], []
    width = 4
    for seq, (length, rows) in enumerate(zip(lens, rows_per_seq, strict=True), start=first):
        table = [(seq * 7 + j * 3) % BLOCKS for j in range(width)]  # distinct blocks per sequence
        assert len(set(table)) == width
        for p in range(length - rows, length):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            tables.append(table)
            contexts.append(p + 1)
    return (
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32),
    )


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "int4-half"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_stack_gives_the_layer_by_layer_bits(kind: str, bias: bool) -> None:
    if kind == "int4-half" and not _kernels().gemm.half_scales:
        pytest.skip("float16 scales need F16C")
    # one sequence decoding, one prefilling 5 rows, one decoding past a block boundary
    step = _step([9, 5, 13], [1, 5, 1])
    rows = step[0].shape[0]
    final_norm = torch.rand(SHAPE.hidden) + 0.5
    h = torch.randn(rows, SHAPE.hidden, generator=torch.Generator().manual_seed(5))
    layered_layers = _layers(kind, 3, bias, seed=11)
    want = _layered(layered_layers, final_norm, h.clone(), (step[0], step[1], step[2], step[3]))
    fused_layers = _layers(kind, 3, bias, seed=11)  # the same weights, fresh caches
    stack = _kernels().stack.bind(SHAPE, fused_layers, final_norm, _rotary())
    got = stack(h.clone(), step[0], step[1], step[2], step[3])
    assert torch.equal(got, want)
    for fused, layered in zip(fused_layers, layered_layers, strict=True):  # the rows' K and V stored alike
        assert torch.equal(fused.k_cache, layered.k_cache) and torch.equal(fused.v_cache, layered.v_cache)


def test_a_row_of_the_stack_is_the_same_alone_and_in_a_batch() -> None:
    final_norm = torch.rand(SHAPE.hidden) + 0.5
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(3, SHAPE.hidden, generator=gen)
    batch = _step([6, 10, 3], [1, 1, 1])
    stack = _kernels().stack.bind(SHAPE, _layers("int4", 2, False, seed=3), final_norm, _rotary())
    together = stack(h.clone(), *batch)
    alone_step = _step([10], [1], first=1)
    alone = _kernels().stack.bind(SHAPE, _layers("int4", 2, False, seed=3), final_norm, _rotary())
    assert torch.equal(alone(h[1:2].clone(), *alone_step)[0], together[1])


def test_binding_refuses_weights_that_do_not_fit() -> None:
    stack, final_norm = _kernels().stack, torch.ones(SHAPE.hidden)
    layers = _layers("float32", 1, False, seed=1)
    with pytest.raises(ValueError, match="at least one layer"):
        stack.bind(SHAPE, [], final_norm, _rotary())
    wrong = StackLayer(**{**vars(layers[0]), "o": layers[0].qkv})
    with pytest.raises(ValueError, match="layer 0's o multiplies 64 inputs into 128 outputs"):
        stack.bind(SHAPE, [wrong], final_norm, _rotary())
    short = StackLayer(**{**vars(layers[0]), "post_norm": torch.ones(SHAPE.hidden - 1)})
    with pytest.raises(ValueError, match="post_norm must be"):
        stack.bind(SHAPE, [short], final_norm, _rotary())
    half = StackLayer(**{**vars(layers[0]), "k_cache": layers[0].k_cache.half()})
    with pytest.raises(ValueError, match="k_cache must be a contiguous float32"):
        stack.bind(SHAPE, [half], final_norm, _rotary())
    odd_heads = StackShape(**{**vars(SHAPE), "head_dim": 24})
    with pytest.raises(ValueError, match="not the C attention's shape"):
        stack.bind(odd_heads, layers, final_norm, _rotary())
    with pytest.raises(ValueError, match="rotary tables"):
        stack.bind(SHAPE, layers, final_norm, (torch.ones(128, 8), torch.ones(128, 8)))


def test_a_step_the_stack_cannot_read_is_refused() -> None:
    stack = _kernels().stack.bind(
        SHAPE, _layers("float32", 1, False, seed=1), torch.ones(SHAPE.hidden), _rotary()
    )
    positions, slots, tables, lens = _step([5], [1])
    with pytest.raises(ValueError, match="h must be"):
        stack(torch.randn(1, SHAPE.hidden + 1), positions, slots, tables, lens)
    with pytest.raises(ValueError, match="slots must be"):
        stack(torch.randn(1, SHAPE.hidden), positions, slots.int(), tables, lens)
    with pytest.raises(ValueError, match="block_tables must be"):
        stack(torch.randn(2, SHAPE.hidden), positions.repeat(2), slots.repeat(2), tables, lens.repeat(2))
    assert stack(torch.empty(0, SHAPE.hidden), *(t[:0] for t in (positions, slots, tables, lens))).shape == (
        0,
        64,
    )
