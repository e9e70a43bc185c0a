"""The token bitmask: one bit per vocabulary id, 32 ids to an int32 word, and applying it to logits.

Layout (shared by xgrammar, llguidance and outlines-core): row r, word w, bit b (least significant
first) is token 32 * w + b; 1 = allowed. Each guided sequence's matcher fills its row on the CPU;
the (batch, words) tensor is then applied to the logits in one call, before any sampler setting.
"""

from __future__ import annotations

import torch

# (256, 8) float32: byte value -> the additive mask of its 8 tokens (0 allowed, -inf not), bit 0 first.
# An embedding lookup over the bitmask's bytes then yields the whole additive mask in one pass:
# measured on the 2-core CPU at batch 64 x 49,152 ids, 2.2 ms against 8.2 ms for xgrammar's CPU
# kernel and 11 ms or more for a shift-and-test unpack + masked_fill_ (docs/BENCHMARKS.md).
_BYTE_TABLE = torch.where(
    ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(),
    torch.tensor(0.0),
    torch.tensor(float("-inf")),
)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` token ids."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """(batch, words) int32 on the CPU, every token allowed."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place. logits: (batch, width) float32/16.

    `rows`: the logits rows the bitmask's rows stand for, in order (the guided sequences of a mixed
    batch); None means row i of the bitmask is row i of the logits. Ids past the bitmask's cover
    (the model's logits may be wider than the tokenizer's vocabulary: padding rows of the
    embedding) are disallowed: no tokenizer piece stands behind them.
    """
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
    num = bitmask.shape[0]
    assert num == (logits.shape[0] if rows is None else len(rows)), (logits.shape, bitmask.shape)
    width = logits.shape[1]
    covered = min(width, bitmask.shape[1] * 32)
    table = _BYTE_TABLE.to(logits.device, logits.dtype)
    # (num, words * 4) bytes -> (num, words * 32) additive mask; little-endian bytes keep bit order
    as_bytes = bitmask.contiguous().view(torch.uint8).to(logits.device, torch.int64, non_blocking=True)
    additive = torch.nn.functional.embedding(as_bytes, table).view(num, -1)[:, :covered]
    if rows is None:
        logits[:, :covered] += additive
        if covered < width:
            logits[:, covered:] = float("-inf")
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, index)
    sub[:, :covered] += additive
    if covered < width:
        sub[:, covered:] = float("-inf")
    logits.index_copy_(0, index, sub)
