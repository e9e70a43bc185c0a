"""One user's decode speed: the engine vs HF transformers (and llama.cpp when it is here), one run.

The default model in float32 with N threads (2), a P-token prompt (128) and G greedy tokens (128),
one request at a time, each configuration in its own process (the MKL mode `engine serve` gives
it: engine/layers/cpu_blas.py). ms/token of decode = (time for G tokens - time for 1 token) / (G - 1), best
of R runs (3), for: HF `generate`; the engine with batch invariance (its default) and without it
(the C decode kernels for a step's few rows, and once without them: torch operations only),
in float32, int8 and int4; and llama.cpp's `llama-bench` on
GGUF files of the same weights when `--llama-bench` or $LLAMA_BENCH names the binary and `--gguf`
the files (skipped otherwise).
Also the engine's fixed cost per decode step: the step's time outside the model's forward pass and
LM head (scheduling, batch preparation, sampling, detokenizing, outputs).

Usage: python bench/decode_batch1.py [--prompt-len 128] [--new-tokens 128] [--threads 2]
           [--runs 3] [--llama-bench PATH --gguf FILE [--gguf FILE2]]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams
from engine.default_model import prepare_default_model
from engine.layers.cpu_blas import request_strict_mkl, rows_are_invariant
from kernels import cpu_native
from kernels.reference import ROW_MULTIPLE


def decode_ms(run: Callable[[int], object], new_tokens: int, runs: int) -> float:
    """Best-of-`runs` decode ms/token: (G tokens - 1 token) / (G - 1)."""
    run(new_tokens)  # warm-up
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        run(new_tokens)
        whole = time.perf_counter() - start
        start = time.perf_counter()
        run(1)
        first = time.perf_counter() - start
        best = min(best, (whole - first) / (new_tokens - 1) * 1e3)
    return best


def hf_ms(model_dir: Path, prompt: list[int], new_tokens: int, runs: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return decode_ms(run, new_tokens, runs)


def engine_ms(prompt: list[int], new_tokens: int, runs: int, **options: Any) -> tuple[float, float]:
    """(decode ms/token, the step's ms outside the model) for one engine configuration."""
    llm = LLM("default", max_model_len=2048, enable_prefix_caching=False, **options)
    model = llm.engine.runner.model
    inside = [0.0]

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: Any) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - start

        return wrapper

    model.forward = timed(model.forward)  # type: ignore[method-assign]
    model.compute_logits = timed(model.compute_logits)  # type: ignore[method-assign]

    def run(n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

    ms = decode_ms(run, new_tokens, runs)
    steps = 200
    run(2)  # prefill + one decode, then time decode steps alone
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    llm.engine.add_request("fixed", prompt, params)
    llm.engine.step()  # the prefill
    inside[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    outside = (time.perf_counter() - start - inside[0]) / steps * 1e3
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return ms, outside


def llama_cpp_ms(binary: str, gguf: Path, prompt_len: int, new_tokens: int, threads: int) -> float | None:
    """llama-bench's text-generation ms/token (tg N after a P-token prompt), or None if it failed."""
    cmd = [binary, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-pg", f"{prompt_len},{new_tokens}",
           "-t", str(threads), "-o", "csv"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [line.split(",") for line in done.stdout.splitlines()]
    if done.returncode != 0 or len(rows) < 2:
        print(f"llama-bench failed ({done.returncode}): {done.stderr[-300:]}")
        return None
    header = [h.strip('"') for h in rows[0]]
    for row in rows[1:]:
        fields = dict(zip(header, (v.strip('"') for v in row), strict=False))
        if fields.get("n_prompt") == "0" and fields.get("n_gen") == str(new_tokens):
            return 1e3 / float(fields["avg_ts"])
    return None


def isolated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a fresh process: each configuration gets the MKL mode `engine serve`
    would give it (strict reproducible mode only with batch invariance: engine/layers/cpu_blas.py),
    which is fixed at a process's first product."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def engine_run(
    threads: int, prompt: list[int], new_tokens: int, runs: int, cpu_kernels: bool = True, **options: Any
) -> tuple[float, float, bool]:
    """`engine_ms` as `engine serve` runs it, and whether batch invariance was really on.
    `cpu_kernels=False`: without the C decode kernels (kernels/cpu_native.py): torch operations only."""
    torch.set_num_threads(threads)
    if not cpu_kernels:
        cpu_native.load = lambda *args, **kwargs: None  # this process only (isolated)
    if options.get("batch_invariant", True):
        request_strict_mkl()
    ms, outside = engine_ms(prompt, new_tokens, runs, **options)
    return ms, outside, rows_are_invariant(torch.float32, 576, ROW_MULTIPLE)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"))
    parser.add_argument(
        "--gguf", type=Path, action="append", default=[], help="the same weights as a GGUF file (repeatable)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = prepare_default_model()
    prompt = [(i * 7919) % 40000 + 1000 for i in range(args.prompt_len)]
    print(f"default model, float32, {args.threads} threads, {args.prompt_len}-token prompt, "
          f"{args.new_tokens} greedy tokens, best of {args.runs}")  # fmt: skip
    hf = isolated(hf_ms, model_dir, prompt, args.new_tokens, args.runs)
    print(f"  HF transformers generate            {hf:7.1f} ms/token")
    results = {}
    configurations: list[tuple[str, dict[str, Any]]] = [
        ("engine, batch-invariant (default)", {}),
        ("engine, --no-batch-invariant", {"batch_invariant": False}),
        ("engine, --no-batch-invariant, no C kernels", {"batch_invariant": False, "cpu_kernels": False}),
        ("engine int8, batch-invariant", {"quantization": "int8"}),
        ("engine int8, --no-batch-invariant", {"quantization": "int8", "batch_invariant": False}),
        ("engine int4, batch-invariant", {"quantization": "int4"}),
        ("engine int4, --no-batch-invariant", {"quantization": "int4", "batch_invariant": False}),
    ]
    for name, options in configurations:
        ms, outside, invariant = isolated(
            engine_run, args.threads, prompt, args.new_tokens, args.runs, **options
        )
        results[name] = ms
        note = "" if invariant or not options.get("batch_invariant", True) else " (NOT batch-invariant here)"
        print(f"  {name:<40} {ms:7.1f} ms/token  ({hf / ms:.2f}x HF; outside the model "
              f"{outside:.2f} ms per step){note}")  # fmt: skip
    if args.llama_bench and args.gguf:
        for gguf in args.gguf:
            cpp = llama_cpp_ms(args.llama_bench, gguf, args.prompt_len, args.new_tokens, args.threads)
            if cpp is None:
                continue
            print(f"  llama.cpp ({gguf.name})  {cpp:7.1f} ms/token")
            for name, ms in results.items():
                print(f"    {name}: {ms / cpp:.2f}x its ms/token")
    else:
        print("  llama.cpp: skipped (give --llama-bench and --gguf, or set LLAMA_BENCH)")
    if re.search("AVX512", torch.__config__.show()):
        print("  (CPU capability: AVX512)")


if __name__ == "__main__":
    main()
