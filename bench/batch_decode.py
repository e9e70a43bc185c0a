"""Batch decode throughput by weight precision: the engine's float32 against its quantized forms.

The default model with N threads (2): B copies (32) of a P-token prompt (128), G greedy tokens
each (64, `ignore_eos`), all admitted at once; decode tok/s = B x (G - 1) / (time for G tokens -
time for 1 token), best of R runs (3). Each configuration runs in its own process (the MKL mode
`engine serve` gives it: engine/layers/cpu_blas.py), with batch invariance (the default) and
without it, for float32, int8, int4 and w8a8; the ratio to float32 in the same mode is printed
(issue 17's target: int8 >= 1.5x float32 at batch 32).

Usage: python bench/batch_decode.py [--batch 32] [--prompt-len 128] [--new-tokens 64] [--runs 3]
           [--threads 2] [--quantization int8 --quantization w8a8 ...] [--march haswell]

`--march` builds the C kernels for another instruction set than this CPU's (`-march=haswell`:
AVX2 and FMA, no AVX-512, no VNNI) to measure here the code a CPU of that generation runs; its
speed is this CPU's running that code, not the older CPU's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams
from engine.default_model import prepare_default_model
from engine.layers.cpu_blas import request_strict_mkl


def decode_tok_s(
    threads: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    runs: int,
    march: str | None = None,
    **options: Any,
) -> float:
    """Best-of-`runs` decode tokens/s of `batch` sequences for one engine configuration."""
    torch.set_num_threads(threads)
    if march is not None:  # before the engine loads the kernels (the flags are part of the build's key)
        from kernels import cpu_native

        flags = cpu_native.FLAGS
        cpu_native.FLAGS = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in flags)
    if options.get("batch_invariant", True):
        request_strict_mkl()
    llm = LLM("default", max_model_len=1024, enable_prefix_caching=False, max_num_seqs=batch, **options)
    prompt = [(i * 7919) % 40000 + 1000 for i in range(prompt_len)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
        return time.perf_counter() - start

    run(new_tokens)  # warm-up
    best = 0.0
    for _ in range(runs):
        whole, first = run(new_tokens), run(1)
        best = max(best, batch * (new_tokens - 1) / (whole - first))
    return best


def isolated(**kwargs: Any) -> float:
    """`decode_tok_s` in a fresh process (MKL's mode is fixed at a process's first product)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(decode_tok_s, **kwargs).result()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", action="append", default=None, help="int8, int4, w8a8 (repeatable)")
    parser.add_argument("--march", default=None, help="build the C kernels with -march=M (default: native)")
    args = parser.parse_args()
    prepare_default_model()
    forms = args.quantization or ["int8", "int4", "w8a8"]
    print(f"default model, {args.threads} threads, batch {args.batch}, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} greedy tokens, best of {args.runs}, C kernels -march={args.march or 'native'}: "
          "decode tok/s")  # fmt: skip
    common = dict(threads=args.threads, batch=args.batch, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, runs=args.runs, march=args.march)  # fmt: skip
    for invariant in (True, False):
        mode = "batch-invariant" if invariant else "--no-batch-invariant"
        base = isolated(**common, batch_invariant=invariant)
        print(f"  float32, {mode:<22} {base:8.1f} tok/s  1.00x")
        for form in forms:
            tok_s = isolated(**common, batch_invariant=invariant, quantization=form)
            print(f"  {form}, {mode:<25} {tok_s:8.1f} tok/s  {tok_s / base:.2f}x float32")


if __name__ == "__main__":
    main()
