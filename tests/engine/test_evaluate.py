"""`python -m engine eval` and the scoring under it (engine/evaluate.py), on tiny models."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLM
from engine.evaluate import first_divergence, next_token_logprobs, reference_text, top1_agreement


def test_a_windows_logprobs_are_those_of_hf_transformers(tiny_model_factory: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("qwen3")
    tokens = [(i * 31) % 400 + 5 for i in range(70)]
    llm = LLM(str(path), enable_prefix_caching=False)
    ours = next_token_logprobs(llm, tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert ours.shape == (69,)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    # scoring leaves the engine as it was: a generation afterwards is what it was before
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate([tokens[:20]], params, use_tqdm=False)[0].outputs[0].token_ids
    next_token_logprobs(llm, tokens)
    assert llm.generate([tokens[:20]], params, use_tqdm=False)[0].outputs[0].token_ids == before
    # an engine ranks its own greedy tokens first; another continuation mostly not
    assert top1_agreement(llm, [tokens[:20]], [before]) == 1.0
    assert top1_agreement(llm, [tokens[:20]], [[t + 1 for t in before]]) < 0.5


def test_the_reference_text_is_fixed_and_the_divergence_is_the_first_difference(
    tiny_chat_model: Path,
) -> None:
    tokenizer = LLM(str(tiny_chat_model)).get_tokenizer()
    text = reference_text(tokenizer, 300)
    assert len(text) == 300 and text == reference_text(tokenizer, 300)
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2]) == 2


def test_the_eval_command_prints_both_precisions_side_by_side(tiny_chat_model: Path) -> None:
    cmd = [sys.executable, "-m", "engine", "eval", "--model", str(tiny_chat_model), "--quantization", "int8",
           "--kv-cache-dtype", "int8",
           "--text-tokens", "400", "--window", "128", "--prompts", "3", "--new-tokens", "6"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ppl = re.search(r"perplexity\s+([\d.]+)\s+([\d.]+)\s+\(([-+][\d.]+)%\)", done.stdout)
    assert ppl is not None, done.stdout
    full, int8 = float(ppl.group(1)), float(ppl.group(2))
    assert full > 1 and int8 > 1 and abs(int8 / full - 1) < 0.05
    assert re.search(r"task accuracy\s+[\d.]+%\s+[\d.]+%", done.stdout)
    assert re.search(r"full precision\s+int8 \+ kv int8", done.stdout)
    assert re.search(r"greedy agreement: \d/3 answers identical over 6 tokens", done.stdout)
    agreement = r"teacher-forced top-1 agreement: [\d.]+% of full precision's 18 greedy tokens"
    assert re.search(agreement, done.stdout)
    alone = subprocess.run([*cmd, "--baseline"], capture_output=True, text=True, timeout=300, check=False)
    assert alone.returncode == 0 and alone.stdout.startswith("full precision: perplexity ")
