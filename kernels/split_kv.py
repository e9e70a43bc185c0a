"""How many programs share one decode sequence's KV (flash-decoding); importable without Triton."""

from __future__ import annotations

import torch

MAX_SPLITS = 32


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """KV splits per sequence: enough programs to fill the GPU, never slices under 256 tokens."""
    by_length = max(1, -(-max_context // 256))
    if device.type != "cuda":  # the interpreter pays per program: split only long contexts
        return min(by_length, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, by_length, MAX_SPLITS))
