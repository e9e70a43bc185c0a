"""Greedy comparison against HF transformers, tolerating only genuine near-ties."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

TIE_TOLERANCE = 1e-4


@dataclass
class HFReference:
    """HF's greedy tokens and per-step logits for each prompt (run one prompt at a time: no padding)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # (steps, vocab) per prompt


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> HFReference:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.cat(out.logits, dim=0).float())
    return HFReference(tokens, logits)


@dataclass
class Comparison:
    """Outcome of comparing our tokens to HF's for a batch."""

    ties: int = 0
    mismatches: list[str] = field(default_factory=list)


def compare_greedy(ours: list[list[int]], ref: HFReference) -> Comparison:
    """Token-for-token equality, except a first difference at a near-tie in HF's own logits."""
    result = Comparison()
    for i, (mine, theirs) in enumerate(zip(ours, ref.tokens, strict=True)):
        n = min(len(mine), len(theirs))
        diff = next((j for j in range(n) if mine[j] != theirs[j]), None)
        if diff is None:
            if len(mine) != len(theirs):
                result.mismatches.append(f"prompt {i}: lengths differ ({len(mine)} vs HF {len(theirs)})")
            continue
        step_logits = ref.logits[i][diff]
        gap = abs(float(step_logits[theirs[diff]] - step_logits[mine[diff]]))
        if gap <= TIE_TOLERANCE:
            result.ties += 1
        else:
            result.mismatches.append(
                f"prompt {i}: step {diff}: ours {mine[diff]} vs HF {theirs[diff]} (logit gap {gap:.2e})"
            )
    return result
