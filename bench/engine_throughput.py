"""Engine vs HF transformers static batching, prefix-cache TTFT, and KV memory efficiency.

Usage: python bench/engine_throughput.py [--num-requests 64] [--batch-size 16] [--quick]
       python bench/engine_throughput.py --device cuda [--model default|llama-1b|PATH]
           (GPU: 256 concurrent requests by default, bf16, plus the batch-1 decode step time
           against the roofline: bytes of weights + KV read per step / peak HBM bandwidth)
Prints each figure side by side and the ratios (ours / baseline). Not part of CI.
`llama-1b` is a Llama-3.2-1B-shaped model with random weights, built from its config (no hub)
into the model cache the first time.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_peaks import device_peaks
from engine import LLM, SamplingParams
from engine.config import model_cache_dir
from engine.default_model import prepare_default_model

# Llama-3.2-1B's shape (random weights: throughput does not depend on their values)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def random_llama_1b() -> Path:
    """A ~1.2B-parameter Llama folder with random bf16 weights, built once in the model cache."""
    out = model_cache_dir() / "random-llama-1b"
    if (out / "model.safetensors").exists():  # saved whole: the folder appears by one rename
        return out
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA_1B, bos_token_id=1, eos_token_id=2)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".random-llama-1b-", dir=out.parent))
    try:
        model.save_pretrained(str(partial), max_shard_size="100GB")  # one file: model.safetensors
        shutil.rmtree(out, ignore_errors=True)  # a folder an interrupted older build left
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


LLM_VOCAB_LIMIT = 49000  # SmolLM2's vocabulary is 49152


def make_workload(
    n: int,
    seed: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int = LLM_VOCAB_LIMIT,
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
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
        for out in engine.step():  # each step's outputs are deltas: only the new tokens
            tokens += len(out.token_ids)
        used_blocks = bm.num_blocks - bm.num_free_blocks
        if used_blocks:
            held = sum(s.num_computed_tokens for s in engine.scheduler.running)
            efficiency.append(held / (used_blocks * bm.block_size))
    return time.perf_counter() - start, tokens, statistics.fmean(efficiency)


def run_hf_static(model_dir: str, wl: Workload, batch_size: int) -> tuple[float, int]:
    """HF generate over padded batches of `batch_size` in arrival order; counts requested tokens."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for b in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[b : b + batch_size]
            outs = wl.output_lens[b : b + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
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
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, useful


def decode_roofline(llm: LLM, prompt_len: int, steps: int, vocab: int) -> None:
    """Batch-1 decode step time vs bytes of weights + KV read per step / peak bandwidth (CUDA)."""
    engine = llm.engine
    runner = engine.runner
    mc = engine.model_config
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    # every weight is read once per step (the embedding table once, as the tied LM head)
    weight_bytes = sum(p.numel() for p in runner.model.parameters()) * elem
    prompt = [random.Random(1).randrange(100, vocab - 1) for _ in range(prompt_len)]
    engine.add_request(
        "roofline", prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    )
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        begin = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    step = statistics.median(times)
    ctx = prompt_len + steps / 2  # mean context over the measured steps
    kv_bytes = 2 * mc.num_layers * ctx * mc.num_kv_heads * mc.head_dim * elem
    name = torch.cuda.get_device_name()
    peaks = device_peaks(name)
    graphs = "CUDA graphs" if runner.graphs is not None else "eager"
    print(
        f"batch-1 decode ({graphs}): median step {step * 1000:.3f} ms over {len(times)} steps; "
        f"reads {(weight_bytes + kv_bytes) / 1e6:.1f} MB per step"
    )
    if peaks is None:
        print(f"  no data-sheet bandwidth for {name!r}: roofline not computed")
        return
    roofline = (weight_bytes + kv_bytes) / (peaks[0] * 1e9)
    print(
        f"  roofline at {peaks[0]:.0f} GB/s: {roofline * 1000:.3f} ms -> {step / roofline:.2f}x the roofline"
    )


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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--model", default="default", help="default (SmolLM2-135M), llama-1b (random), a path"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    parser.add_argument("--quick", action="store_true", help="a small workload, for a smoke run")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.model == "default":
        model_dir = str(prepare_default_model())
    elif args.model == "llama-1b":
        model_dir = str(random_llama_1b())
    else:
        model_dir = args.model
    n, prompts, outputs = args.num_requests, (32, 512), (16, 256)
    if cuda and "--batch-size" not in sys.argv:  # the GPU comparison: 256 concurrent requests
        n, args.batch_size = max(n, 512), 256
    if args.quick:
        n, prompts, outputs, args.prefix_requests = 8, (32, 128), (8, 32), 4
    vocab = LLM_VOCAB_LIMIT if args.model == "default" else 128000
    wl = make_workload(n, args.seed, prompts, outputs, vocab)
    print(
        f"workload: {n} requests, prompts {prompts}, outputs {outputs}, batch {args.batch_size}, "
        f"threads {torch.get_num_threads()}"
    )

    hf_result = None
    if cuda and not args.skip_hf:  # before the engine takes its share of the GPU memory
        hf_result = run_hf_static(model_dir, wl, args.batch_size)
        torch.cuda.empty_cache()
    llm = LLM(
        model_dir,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=2048 if not cuda else 8192,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}; kernels: {llm.engine.runner.backend.name}")
        run_engine(llm, make_workload(8, args.seed + 1, (16, 64), (4, 8), vocab))  # warm-up: Triton compiles
    secs, toks, eff = run_engine(llm, wl)
    ours = toks / secs
    print(f"engine      : {toks} output tokens in {secs:.1f}s = {ours:.1f} tok/s; KV efficiency {eff:.3f}")
    if not args.skip_hf:
        hf_secs, hf_toks = hf_result or run_hf_static(model_dir, wl, args.batch_size)
        theirs = hf_toks / hf_secs
        print(f"hf static   : {hf_toks} output tokens in {hf_secs:.1f}s = {theirs:.1f} tok/s")
        print(f"throughput ratio (engine / hf static): {ours / theirs:.2f}x")
    if cuda:
        decode_roofline(llm, 512, 128, vocab)
        return
    on, off = prefix_cache_ttft(model_dir, args.prefix_requests, 1000 if not args.quick else 200, args.seed)
    print(
        f"prefix cache: median TTFT {on * 1000:.0f} ms with caching vs {off * 1000:.0f} ms without "
        f"= {off / on:.1f}x lower"
    )


if __name__ == "__main__":
    main()
