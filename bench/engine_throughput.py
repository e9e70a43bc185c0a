"""Engine vs HF transformers static batching, prefix-cache TTFT, and KV memory efficiency.

Usage: python bench/engine_throughput.py [--num-requests 64] [--batch-size 16] [--quick]
Prints each figure side by side and the ratios (ours / baseline). Not part of CI.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine import LLM, SamplingParams
from engine.default_model import prepare_default_model


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def run_engine(llm: LLM, wl: Workload) -> tuple[float, int, float]:
    """Returns (seconds, output tokens, mean KV efficiency: tokens held / token slots allocated)."""
    engine = llm.engine
    bm = engine.block_manager
    for i, (p, m) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    efficiency: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
        used_blocks = bm.num_blocks - bm.num_free_blocks
        if used_blocks:
            held = sum(s.num_computed_tokens for s in engine.scheduler.running)
            efficiency.append(held / (used_blocks * bm.block_size))
    return time.perf_counter() - start, tokens, statistics.fmean(efficiency)


def run_hf_static(model_dir: str, wl: Workload, batch_size: int) -> tuple[float, int]:
    """HF generate over padded batches of `batch_size` in arrival order; counts requested tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for b in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[b : b + batch_size]
            outs = wl.output_lens[b : b + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            longest = max(outs)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
            useful += sum(outs)  # tokens past a request's own max_tokens are waste
    return time.perf_counter() - start, useful


def prefix_cache_ttft(model_dir: str, n: int, system_len: int, seed: int) -> tuple[float, float]:
    """Median TTFT of requests sharing a long system prompt, cache on vs off (requests arrive in turn)."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 49000) for _ in range(system_len)]
    prompts = [system + [rng.randrange(100, 49000) for _ in range(rng.randint(10, 30))] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    medians = []
    for caching in (True, False):
        llm = LLM(model_dir, enable_prefix_caching=caching, max_num_batched_tokens=2048)
        llm.generate([system + [5]], params, use_tqdm=False)  # an earlier request with the same system prompt
        ttfts = []
        for p in prompts:
            out = llm.generate([p], params, use_tqdm=False)[0]
            assert out.metrics.time_to_first_token is not None
            ttfts.append(out.metrics.time_to_first_token)
        medians.append(statistics.median(ttfts))
    return medians[0], medians[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="HF static batch size and our max_num_seqs"
    )
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a small workload, for a smoke run")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    model_dir = str(prepare_default_model())
    n, prompts, outputs = args.num_requests, (32, 512), (16, 256)
    if args.quick:
        n, prompts, outputs, args.prefix_requests = 8, (32, 128), (8, 32), 4
    wl = make_workload(n, args.seed, prompts, outputs)
    print(
        f"workload: {n} requests, prompts {prompts}, outputs {outputs}, batch {args.batch_size}, "
        f"threads {torch.get_num_threads()}"
    )

    llm = LLM(model_dir, max_num_seqs=args.batch_size, max_num_batched_tokens=2048, device=args.device)
    secs, toks, eff = run_engine(llm, wl)
    ours = toks / secs
    print(f"engine      : {toks} output tokens in {secs:.1f}s = {ours:.1f} tok/s; KV efficiency {eff:.3f}")
    if not args.skip_hf:
        hf_secs, hf_toks = run_hf_static(model_dir, wl, args.batch_size)
        theirs = hf_toks / hf_secs
        print(f"hf static   : {hf_toks} output tokens in {hf_secs:.1f}s = {theirs:.1f} tok/s")
        print(f"throughput ratio (engine / hf static): {ours / theirs:.2f}x")
    on, off = prefix_cache_ttft(model_dir, args.prefix_requests, 1000 if not args.quick else 200, args.seed)
    print(
        f"prefix cache: median TTFT {on * 1000:.0f} ms with caching vs {off * 1000:.0f} ms without "
        f"= {off / on:.1f}x lower"
    )


if __name__ == "__main__":
    main()
