"""`python -m engine eval`: what a precision setting costs in quality, beside full precision.

Three measures, each on data that ships with the project or the Python standard library (no
download), computed by the same engine twice (the setting under test, then full precision):
- perplexity over a fixed text: the first `--text-tokens` tokens of the Python language reference
  topics that CPython ships as `pydoc_data.topics` (English prose with code), in windows of
  `--window` tokens, each scored by one prefill through the engine's own model and KV pool;
- greedy agreement: `--prompts` fixed prompts, `--new-tokens` greedy tokens each, and the
  position where each answer first differs from full precision's; and, since one near-tie flipped
  early sends the rest of an answer elsewhere, the share of full precision's greedy tokens that the
  setting under test also ranks first when fed the same prefix (teacher-forced top-1 agreement);
- accuracy on a small task set (engine/data/eval_tasks.json, ours): multiple choice, the answer
  being the option whose tokens the model finds likeliest after the question.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

TASKS = Path(__file__).parent / "data" / "eval_tasks.json"
PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The capital of France is",
    "To make a cup of tea, first",
    "In mathematics, a prime number is",
    "The best way to learn a new language is",
    "import numpy as np\n",
    "Dear hiring manager,",
    "The three states of matter are",
    "A healthy breakfast includes",
    "The main causes of the First World War were",
    "SELECT name FROM users WHERE",
    "Water boils at",
    "The planets of the solar system are",
]


@dataclass
class EvalResult:
    """One engine configuration's figures."""

    perplexity: float
    greedy: list[list[int]]  # each prompt's greedy tokens
    accuracy: float
    top1_agreement: float | None = None  # share of a reference's greedy tokens this engine ranks first


class _Window:
    """What ModelRunner.prepare reads of a sequence: one prefill of `tokens` over blocks 0.. of the pool."""

    def __init__(self, tokens: list[int], block_size: int) -> None:
        self.token_ids = tokens
        self.num_computed_tokens = 0
        self.num_tokens = len(tokens)
        self.block_table = list(range(-(-len(tokens) // block_size)))


def reference_text(tokenizer: Any, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of CPython's bundled language-reference topics, in key order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids: list[int] = tokenizer.encode(text[: num_tokens * 8], add_special_tokens=False)
    return ids[:num_tokens]


@torch.inference_mode()
def next_token_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) for each i: one prefill through the engine's model."""
    logprobs = prefill_logprobs(llm, tokens)
    targets = torch.tensor(tokens[1:], device=logprobs.device)
    return logprobs.gather(1, targets[:, None])[:, 0].cpu()


@torch.inference_mode()
def prefill_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """(len(tokens) - 1, vocab) next-token log-probabilities after each prefix but the whole.

    Needs an idle engine (it writes its KV to the first blocks of the pool) and a window that fits
    the pool and max_model_len.
    """
    from engine.scheduler import ScheduledSeq

    runner = llm.engine.runner
    window: Any = _Window(tokens, runner.block_size)
    if len(window.block_table) > runner.layout.num_blocks or len(tokens) > runner.max_model_len:
        raise ValueError(f"a window of {len(tokens)} tokens does not fit the KV pool or max_model_len")
    input_ids, positions, meta, _ = runner.prepare([ScheduledSeq(window, len(tokens))])
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)[: len(tokens) - 1]
    logits = runner.model.compute_logits(hidden)
    llm.engine.block_manager.reset_prefix_cache()  # those blocks' KV is ours now, not what it cached
    return torch.log_softmax(logits, dim=-1)


def top1_agreement(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of the continuations' tokens that `llm` ranks first after the prompt and the tokens
    before them (teacher-forced: every position is judged on the same prefix)."""
    agree = total = 0
    for prompt, tokens in zip(prompts, continuations, strict=True):
        if not tokens:
            continue
        logprobs = prefill_logprobs(llm, prompt + tokens)[len(prompt) - 1 :]
        agree += int((logprobs.argmax(dim=-1).cpu() == torch.tensor(tokens)).sum())
        total += len(tokens)
    return agree / total if total else 1.0


def perplexity(llm: LLM, tokens: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) over `tokens`, scored in windows of `window` tokens."""
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window + 1]
        if len(chunk) < 2:
            break
        logprobs = next_token_logprobs(llm, chunk)
        total -= float(logprobs.sum())
        count += len(chunk) - 1
    return math.exp(total / count)


def task_accuracy(llm: LLM, tasks: list[dict[str, Any]]) -> float:
    """Share of tasks whose answer is the option with the highest summed logprob after the question."""
    tokenizer = llm.get_tokenizer()
    right = 0
    for task in tasks:
        question = tokenizer.encode(task["question"], add_special_tokens=False)
        scores = []
        for option in task["options"]:
            answer = tokenizer.encode(option, add_special_tokens=False)
            logprobs = next_token_logprobs(llm, question + answer)
            scores.append(float(logprobs[len(question) - 1 :].sum()))
        right += int(max(range(len(scores)), key=scores.__getitem__) == task["answer"])
    return right / len(tasks)


def evaluate(
    llm: LLM,
    text_tokens: int,
    window: int,
    new_tokens: int,
    num_prompts: int,
    reference: EvalResult | None = None,
) -> EvalResult:
    """Perplexity, greedy answers and task accuracy of one engine; with a `reference` (full
    precision's result), also how often it ranks the reference's greedy tokens first."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("eval needs a model folder with a tokenizer")
    ppl = perplexity(llm, reference_text(tokenizer, text_tokens), window)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tasks = json.loads(TASKS.read_text())
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    agreement = None if reference is None else top1_agreement(llm, prompts, reference.greedy)
    return EvalResult(ppl, greedy, task_accuracy(llm, tasks), agreement)


def setting_name(config: EngineConfig) -> str:
    """A precision setting in a few characters: "int4", "kv int8", "int8 + kv fp8_e4m3"."""
    parts = [config.quantization] if config.quantization else []
    if config.kv_cache_dtype != "auto":
        parts.append(f"kv {config.kv_cache_dtype}")
    return " + ".join(parts) or "full precision"


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where two greedy answers differ (their length when they never do)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def report(name: str, tested: EvalResult, base: EvalResult | None) -> str:
    """The figures as printed, side by side with full precision when given."""
    if base is None:
        return f"{name}: perplexity {tested.perplexity:.3f}, task accuracy {tested.accuracy:.1%}"
    change = (tested.perplexity / base.perplexity - 1) * 100
    divergences = [first_divergence(a, b) for a, b in zip(tested.greedy, base.greedy, strict=True)]
    length = len(base.greedy[0]) if base.greedy else 0
    agree = sum(d == length for d in divergences)
    lines = [
        f"{'':24} {'full precision':>16} {name:>16}",
        f"{'perplexity':24} {base.perplexity:16.3f} {tested.perplexity:16.3f}   ({change:+.2f}%)",
        f"{'task accuracy':24} {base.accuracy:16.1%} {tested.accuracy:16.1%}",
        f"greedy agreement: {agree}/{len(divergences)} answers identical over {length} tokens; "
        f"first divergence at {sorted(divergences)} (median {sorted(divergences)[len(divergences) // 2]})",
    ]
    if tested.top1_agreement is not None:
        lines.append(
            f"teacher-forced top-1 agreement: {tested.top1_agreement:.1%} of full precision's "
            f"{sum(len(g) for g in base.greedy)} greedy tokens"
        )
    return "\n".join(lines)
