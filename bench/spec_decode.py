"""Speculative decoding (prompt lookup) vs plain decoding, the default model, side by side in one run.

Workloads, each run by both engines (same weights, same settings, speculation off / on):
- grounded: rewrite prompts whose answers copy the input. The input is the model's own greedy
  answer to a writing prompt (generated first by the plain engine), so what it copies, and so the
  acceptance rate, is the model's real behaviour, not a planted string.
- random: prompts of random vocabulary tokens (nothing to look up but the model's own repeats).
One request at a time: output tokens/s and the ratio; and the grounded set at concurrency C (16),
all submitted at once. The greedy outputs of both engines are compared token for token.

With --temperature T > 0 the requests are sampled (seeded): drafts are rarely the token drawn, the
case where speculation must switch itself off rather than slow decoding down.

Usage: python bench/spec_decode.py [--k 4] [--lookup-max 4] [--requests 8] [--max-tokens 128]
           [--concurrency 16] [--threads 2] [--no-batch-invariant] [--quantization int4]
           [--temperature 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams

TOPICS = [
    "the water cycle", "how bees make honey", "the history of the bicycle", "why the sky is blue",
    "how a refrigerator works", "the rules of chess", "photosynthesis", "the moon landing",
    "how vaccines work", "the printing press", "volcanoes", "the Roman empire", "recycling plastic",
    "how airplanes fly", "the human heart", "coffee",
]  # fmt: skip


REWRITE = "Rewrite the following paragraph, keeping its wording but fixing any mistakes:\n\n"


def chat(llm: LLM, messages: list[list[dict[str, str]]], params: SamplingParams) -> list[Any]:
    return llm.chat(messages, params, use_tqdm=False)


def grounded_prompts(plain: LLM, count: int) -> list[list[dict[str, str]]]:
    """Rewrite requests over the model's own greedy paragraphs."""
    first = [[{"role": "user", "content": f"Write a short paragraph about {t}."}] for t in TOPICS[:count]]
    drafts = chat(plain, first, SamplingParams(temperature=0, max_tokens=120))
    return [[{"role": "user", "content": REWRITE + d.outputs[0].text.strip()}] for d in drafts]


def random_prompts(llm: LLM, count: int, length: int = 64) -> list[list[dict[str, str]]]:
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    return [
        [{"role": "user", "content": tok.decode([rng.randrange(1000, 40000) for _ in range(length)])}]
        for _ in range(count)
    ]


def one_at_a_time(
    llm: LLM, prompts: list[list[dict[str, str]]], params: SamplingParams
) -> tuple[float, list[Any]]:
    """Output tokens/s over the prompts run one by one, and the outputs."""
    outs, tokens, seconds = [], 0, 0.0
    for p in prompts:
        start = time.perf_counter()
        out = chat(llm, [p], params)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
        outs.append(out)
    return tokens / seconds, outs


def together(llm: LLM, prompts: list[list[dict[str, str]]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = chat(llm, prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def acceptance(llm: LLM, before: Any) -> str:
    spec = llm.engine.speculator
    assert spec is not None
    now = spec.stats()
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    rate = accepted / drafted if drafted else 0.0
    return f"{drafted} drafted, {accepted} accepted ({rate:.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--requests", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16, help="grounded requests at once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampled (seeded) instead of greedy: low acceptance"
    )
    parser.add_argument("--no-batch-invariant", action="store_true")
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options: dict[str, Any] = dict(
        num_threads=args.threads, batch_invariant=not args.no_batch_invariant, quantization=args.quantization
    )
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}  # fmt: skip
    plain = LLM("default", **options)
    spec = LLM("default", **options, speculative_config=spec_config)
    print(f"default model, {args.threads} threads, options {options}, speculative_config {spec_config}")
    seed = 3 if args.temperature > 0 else None  # sampled outputs differ: only their speed compares
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed)
    workloads = {
        "grounded": grounded_prompts(plain, args.requests),
        "random": random_prompts(plain, args.requests),
    }
    for llm in (plain, spec):  # warm-up
        one_at_a_time(llm, workloads["random"][:1], SamplingParams(temperature=0, max_tokens=8))
    for name, prompts in workloads.items():
        before = spec.engine.speculator.stats()  # type: ignore[union-attr]
        rate_spec, outs_spec = one_at_a_time(spec, prompts, params)
        accepted = acceptance(spec, before)
        rate_plain, outs_plain = one_at_a_time(plain, prompts, params)
        pairs = zip(outs_plain, outs_spec, strict=True)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in pairs)
        print(f"{name:>9}, one at a time: plain {rate_plain:6.1f} tok/s, ngram {rate_spec:6.1f} tok/s, "
              f"{rate_spec / rate_plain:.2f}x; {accepted}; "
              f"identical outputs {same}/{len(prompts)}")  # fmt: skip
    prompts = (workloads["grounded"] * args.concurrency)[: args.concurrency]
    before = spec.engine.speculator.stats()  # type: ignore[union-attr]
    rate_spec = together(spec, prompts, params)
    accepted = acceptance(spec, before)
    rate_plain = together(plain, prompts, params)
    print(f" grounded, {args.concurrency} at once: plain {rate_plain:6.1f} tok/s, ngram {rate_spec:6.1f} "
          f"tok/s, {rate_spec / rate_plain:.2f}x; {accepted}")  # fmt: skip


if __name__ == "__main__":
    main()
