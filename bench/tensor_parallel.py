"""Tensor parallelism vs one rank, side by side in one run: output tokens/s and greedy agreement.

Models: the default model (9 heads and 3 KV heads: tensor_parallel_size 3 is the split it allows)
and a random Llama of 8 heads (hidden 1024, 8 layers: sizes 2 and 4), built here. Workload: C
prompts of P random tokens, G greedy tokens each with ignore_eos, all submitted at once. On a CPU
the ranks share the machine's cores (each gets cores / N threads): this measures the split's
overhead and checks its tokens, it is not expected to be faster. On a machine with several GPUs
(`--device cuda`), the same command measures NCCL.

Usage: python bench/tensor_parallel.py [--prompts 16] [--prompt-len 64] [--new-tokens 32]
           [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams


def random_llama(out: Path) -> Path:
    """An 8-head random Llama (about 110M parameters), saved as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def run(
    path: str, size: int, prompts: list[list[int]], params: SamplingParams, options: dict
) -> tuple[float, list]:
    llm = LLM(path, tensor_parallel_size=size, **options)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.engine.close()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in tokens) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    options = {"num_threads": args.threads, "device": args.device, "max_model_len": 1024}
    with tempfile.TemporaryDirectory() as tmp:
        models = [("default", (3,)), (str(random_llama(Path(tmp) / "llama-8h")), (2, 4))]
        print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} greedy tokens each, "
              f"{args.threads} threads, {args.device}")  # fmt: skip
        for path, sizes in models:
            name = "default model" if path == "default" else "random 8-head Llama"
            base, expected = run(path, 1, prompts, params, options)
            print(f"{name}: 1 rank {base:.1f} tok/s")
            for size in sizes:
                rate, tokens = run(path, size, prompts, params, options)
                same = sum(a == b for a, b in zip(tokens, expected, strict=True))
                print(
                    f"  {size} ranks {rate:.1f} tok/s ({rate / base:.2f}x); "
                    f"identical outputs {same}/{len(prompts)}"
                )


if __name__ == "__main__":
    main()
