"""Quantized weights on the GPU, side by side in one run: the Triton int4/int8 matmuls against
bfloat16 `torch.mm`, and the engine's batch-1 / batch-32 decode on a Llama-3.2-1B-shaped model
(random weights) in bfloat16, int8 and int4.

Target (issue 17): the 4-bit decode step at least 2x bfloat16's at batch 1.

Usage: python bench/quant_gpu.py [--quick]   (CUDA only; prints "skipped" without it)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_throughput import random_llama_1b
from engine import LLM, SamplingParams
from engine.layers.quant_triton import TritonInt4Weight, TritonInt8Weight


def cuda_ms(fn: Callable[[], object], reps: int = 50) -> float:
    """Median milliseconds per call, CUDA events around each call after warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def matmuls(quick: bool) -> None:
    """The 1B model's largest projection (gate/up: 16384 x 2048) at decode and prefill row counts."""
    weight = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    int4, int8 = TritonInt4Weight.quantize(weight), TritonInt8Weight.quantize(weight)
    print("gate/up projection 16384 x 2048, ms (x bf16)")
    for rows in (1, 16) if quick else (1, 4, 16, 64, 512):
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        bf16 = cuda_ms(lambda x=x: torch.mm(x, weight.t()))
        i4 = cuda_ms(lambda x=x: int4.matmul(x))
        i8 = cuda_ms(lambda x=x: int8.matmul(x))
        print(
            f"  rows {rows:4}: bf16 {bf16:.3f}  int8 {i8:.3f} ({bf16 / i8:.2f}x)  "
            f"int4 {i4:.3f} ({bf16 / i4:.2f}x)"
        )


def decode(quick: bool) -> None:
    """Decode ms/token of the engine at batch 1 and tok/s at batch 32 per quantization."""
    model = str(random_llama_1b())
    prompt = [(i * 7919) % 30000 + 100 for i in range(128)]
    new = 32 if quick else 128
    results: dict[str, tuple[float, float]] = {}
    for quantization in (None, "int8", "int4"):
        llm = LLM(model, quantization=quantization, max_model_len=1024, max_num_seqs=32)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up

        def timed(batch: int, p: SamplingParams, llm: LLM = llm) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}] * batch, p, use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        ms = (timed(1, params) - timed(1, one)) / (new - 1) * 1e3
        tok_s = 32 * new / timed(32, params)
        results[quantization or "bf16"] = (ms, tok_s)
        del llm
        torch.cuda.empty_cache()
    base_ms, base_tok = results["bf16"]
    print("engine decode, Llama-3.2-1B shape: batch-1 ms/token, batch-32 tok/s (x bf16)")
    for name, (ms, tok_s) in results.items():
        print(
            f"  {name:5} {ms:7.2f} ms/token ({base_ms / ms:.2f}x)   "
            f"{tok_s:8.0f} tok/s ({tok_s / base_tok:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: needs CUDA")
        return
    print(torch.cuda.get_device_name())
    matmuls(args.quick)
    decode(args.quick)


if __name__ == "__main__":
    main()
