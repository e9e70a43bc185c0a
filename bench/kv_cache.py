"""Quantized KV caches side by side in one run: blocks in the same memory, and what they serve.

For each kv_cache_dtype (auto = the model's dtype, int8, fp8_e4m3) the default model gets the same
KV memory (`--memory-mib`, small enough that full precision must preempt) and serves the same
workload (`--requests` prompts of `--prompt-len` tokens, `--new-tokens` greedy tokens each, all
submitted at once): the pool's blocks, how they compare with bfloat16's in the same memory (the
GPU's dtype; on CPU the model runs float32), the preemptions, output tokens per second, and the
batch-1 decode ms/token at a `--long-context` token context (the dequantization's cost).

Usage: python bench/kv_cache.py [--memory-mib 64] [--requests 16] [--prompt-len 256]
           [--new-tokens 64] [--long-context 1024] [--threads 2] [--quantization int4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams
from engine.layers import kv_cache
from engine.models.config import ModelConfig

KV_DTYPES = ("auto", "int8", "fp8_e4m3")


def serve(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """(output tokens per second, preemptions) for the whole batch, submitted at once."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    scheduler = llm.engine.scheduler
    before = scheduler.num_preemptions
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, scheduler.num_preemptions - before


def decode_ms(llm: LLM, context: int, new_tokens: int = 32) -> float:
    """Batch-1 decode ms/token after a `context`-token prompt, from the decode steps alone (the
    prefill is left out of the clock: subtracting a separately timed prefill is noisier than the
    difference it measures at long contexts). Best of 3."""
    prompt = [(i * 7919) % 40000 + 1000 for i in range(context)]
    engine = llm.engine
    best = float("inf")
    for run in range(3):
        engine.add_request(f"decode-{run}", prompt, SamplingParams(temperature=0, max_tokens=new_tokens + 1))
        while not any(seq.num_computed_tokens >= context for seq in engine.scheduler.running):
            engine.step()  # the prefill (in chunks when long)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            engine.step()
        best = min(best, (time.perf_counter() - start) / (new_tokens - 1) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--memory-mib", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [
        [(i * 31 + r * 997) % 40000 + 1000 for i in range(args.prompt_len)] for r in range(args.requests)
    ]
    print(f"default model, {args.threads} threads, weights {args.quantization or 'full precision'}, "
          f"{args.memory_mib} MiB of KV; {args.requests} requests of {args.prompt_len} + {args.new_tokens} "
          f"tokens at once; decode at a {args.long_context}-token context")  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for kv in KV_DTYPES:
        llm = LLM(
            "default",
            kv_cache_memory=args.memory_mib << 20,
            kv_cache_dtype=kv,
            quantization=args.quantization,
            max_model_len=max(args.prompt_len + args.new_tokens, args.long_context + 64),
            enable_prefix_caching=False,
        )
        runner = llm.engine.runner
        mc: ModelConfig = runner.model_config
        bf16 = kv_cache.bytes_per_token(mc.num_kv_heads, mc.head_dim, torch.bfloat16, "auto")
        ours = kv_cache.bytes_per_token(mc.num_kv_heads, mc.head_dim, runner.dtype, kv)
        tok_s, preemptions = serve(llm, prompts, args.new_tokens)
        rows[kv] = {
            "blocks": runner.layout.num_blocks,
            "vs_bf16": bf16 / ours,
            "tok_s": tok_s,
            "preemptions": preemptions,
            "decode_ms": decode_ms(llm, args.long_context),
            "stored": runner.kv_cache_dtype(),
        }
        del llm
    base = rows["auto"]
    print(f"{'kv_cache_dtype':<16}{'blocks':>8}{'x bf16':>8}{'x auto':>8}{'preempt':>9}{'tok/s':>9}"
          f"{'x auto':>8}{'decode ms':>11}{'x auto':>8}")  # fmt: skip
    for kv, r in rows.items():
        name = f"{kv} ({r['stored']})" if kv == "auto" else kv
        print(f"{name:<16}{r['blocks']:>8}{r['vs_bf16']:>8.2f}{r['blocks'] / base['blocks']:>8.2f}"
              f"{r['preemptions']:>9}{r['tok_s']:>9.1f}{r['tok_s'] / base['tok_s']:>8.2f}"
              f"{r['decode_ms']:>11.1f}{r['decode_ms'] / base['decode_ms']:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
