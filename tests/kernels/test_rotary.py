"""Triton rotary embedding against kernels.reference (CPU interpreter, or CUDA when present)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding
from kernels import reference
from kernels.rotary import rotary_embedding
from tests.kernels.devices import DEVICE, TARGETS

MAX_POSITIONS = 256
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # atol = rtol


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual, expected, atol=_TOL[dtype], rtol=_TOL[dtype])


def _tables(head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_positions, head_dim) float32 cos and sin, built by the engine's layer."""
    rope = RotaryEmbedding(head_dim, MAX_POSITIONS, 10000.0, LLAMA3_SCALING).to(device)
    return rope.cos_cache, rope.sin_cache


def _fused_qkv(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (num_tokens, (heads + 2 kv_heads) * head_dim) and its q, k, v head views (not contiguous)."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + heads * 10 + head_dim)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
    return qkv, q, k, v


def _positions(num_tokens: int, device: str) -> torch.Tensor:
    """Distinct positions out of order, reaching the end of the table."""
    gen = torch.Generator().manual_seed(num_tokens)
    pos = torch.randperm(MAX_POSITIONS, generator=gen)[:num_tokens]
    pos[-1] = MAX_POSITIONS - 1
    return pos.to(device)


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (9, 3, 128), (4, 4, 96), (6, 1, 32)],
    ids=["gqa9-3-d64", "gqa9-3-d128", "mha4-d96", "gqa6-1-d32"],
)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rotary_embedding_matches_reference_on_fused_qkv_views(
    device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, num_tokens: int
) -> None:
    qkv, q, k, _ = _fused_qkv(num_tokens, heads, kv_heads, head_dim, device, dtype)
    cos, sin = _tables(head_dim, device)
    positions = _positions(num_tokens, device)
    before = qkv.clone()
    q_out, k_out = rotary_embedding(positions, q, k, cos, sin)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cos, sin)
    assert q_out.is_contiguous() and q_out.dtype == dtype and k_out.shape == k.shape
    _assert_close(q_out, q_ref, dtype)
    _assert_close(k_out, k_ref, dtype)
    assert torch.equal(qkv, before)  # not in place by default


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
def test_rotary_embedding_in_place_rotates_q_and_k_and_leaves_v_alone(
    device: str, dtype: torch.dtype
) -> None:
    _, q, k, v = _fused_qkv(5, 9, 3, 64, device, dtype)
    cos, sin = _tables(64, device)
    positions = _positions(5, device).to(torch.int32)
    q_ref, k_ref = reference.rotary_embedding(positions.long(), q, k, cos, sin)
    v_before = v.clone()
    q_out, k_out = rotary_embedding(positions, q, k, cos, sin, inplace=True)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    _assert_close(q, q_ref, dtype)
    _assert_close(k, k_ref, dtype)
    assert torch.equal(v, v_before)


def test_engine_layer_is_the_reference() -> None:
    _, q, k, _ = _fused_qkv(3, 4, 2, 32, "cpu", torch.float32)
    rope = RotaryEmbedding(32, MAX_POSITIONS, 10000.0, None)
    positions = torch.tensor([7, 0, 3])
    q_layer, k_layer = rope(positions, q, k)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q_layer, q_ref) and torch.equal(k_layer, k_ref)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, device=DEVICE, dtype=dtype)


def _pos(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(n, device=DEVICE, dtype=dtype)


BAD_ROTARY: dict[str, tuple[Callable[[], object], str]] = {
    "k of another dtype": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 8), _t(2, 2, 8, dtype=torch.float16), _t(9, 8), _t(9, 8)),
        "k must have dtype",
    ),
    "odd head_dim": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 7), _t(2, 2, 7), _t(9, 7), _t(9, 7)),
        "head_dim must be even",
    ),
    "float positions": (
        lambda: rotary_embedding(_pos(2, torch.float32), _t(2, 4, 8), _t(2, 2, 8), _t(9, 8), _t(9, 8)),
        "positions must have dtype",
    ),
    "positions of the wrong length": (
        lambda: rotary_embedding(_pos(3), _t(2, 4, 8), _t(2, 2, 8), _t(9, 8), _t(9, 8)),
        "positions must have shape",
    ),
    "k of another head_dim": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 8), _t(2, 2, 16), _t(9, 8), _t(9, 8)),
        "k must have shape",
    ),
    "k of another token count": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 8), _t(3, 2, 8), _t(9, 8), _t(9, 8)),
        "k must have shape",
    ),
    "flat q": (
        lambda: rotary_embedding(_pos(2), _t(2, 32), _t(2, 2, 8), _t(9, 8), _t(9, 8)),
        "q must have 3 dimensions",
    ),
    "q strided in head_dim": (
        lambda: rotary_embedding(_pos(2), _t(2, 8, 4).transpose(1, 2), _t(2, 2, 8), _t(9, 8), _t(9, 8)),
        "q must be contiguous in its last",
    ),
    "cos table of another head_dim": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 8), _t(2, 2, 8), _t(9, 16), _t(9, 16)),
        "cos_cache must have shape",
    ),
    "sin table of another length": (
        lambda: rotary_embedding(_pos(2), _t(2, 4, 8), _t(2, 2, 8), _t(9, 8), _t(5, 8)),
        "sin_cache must have shape",
    ),
}


@pytest.mark.parametrize("case", BAD_ROTARY.keys())
def test_launcher_rejects_bad_arguments(case: str) -> None:
    call, message = BAD_ROTARY[case]
    with pytest.raises(ValueError, match=message):
        call()
