"""Triton attention kernels on the GPU: decode bandwidth and prefill TFLOP/s, beside torch.

Usage: python bench/kernels.py [--quick] [--peak-gbps N] [--peak-tflops N]
  (CUDA only; `TRITON_INTERPRET=1 python bench/kernels.py --smoke` runs tiny shapes on the CPU
  through the interpreter to check the script itself, timing nothing meaningful.)

Decode: one query token per sequence over a paged context; the bytes moved are the K and V of
every context token (the query and output are negligible), so achieved bandwidth = bytes / time,
reported as GB/s and as a share of the device's peak HBM bandwidth. Baseline: the torch
reference (gather the blocks, then scaled_dot_product_attention).
Prefill: fresh prompts of one length, causal; FLOPs = 4 * heads * head_dim * sum(causal pairs).
Baseline: torch scaled_dot_product_attention (flash) on contiguous K/V, which needs no paging.
Target on one H100: decode >= 70% of peak HBM bandwidth at >= 4k context.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_peaks import device_peaks
from kernels import reference
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds per call, CUDA events around each call after warm-up."""
    if not torch.cuda.is_available():
        import time

        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1000 / reps
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def paged_pool(
    contexts: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches with each sequence's blocks shuffled through the pool, and int32 block tables."""
    per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(per_seq)
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    width = max(per_seq)
    tables = []
    for n in per_seq:
        row = [ids.pop() for _ in range(n)]
        tables.append(row + [row[0]] * (width - n))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device)


def _shape(args: argparse.Namespace) -> tuple[int, int, int, int, torch.dtype, str]:
    """(query heads, KV heads, head dim, block size 16, dtype, device) of this run."""
    return args.heads, args.kv_heads, args.head_dim, 16, args.dtype, args.device


def bench_decode(args: argparse.Namespace, peak_gbps: float | None) -> None:
    heads, kv_heads, dim, bs, dtype, device = _shape(args)
    elem = torch.tensor([], dtype=dtype).element_size()
    print(f"\ndecode attention: {heads} query / {kv_heads} KV heads, head_dim {dim}, block {bs}, {dtype}")
    columns = ("batch", 6), ("context", 8), ("triton ms", 10), ("GB/s", 8), ("% peak", 7), ("torch ms", 9)
    print(" ".join(f"{name:>{width}}" for name, width in columns), f"{'speed-up':>9}")
    for ctx in args.contexts:
        for batch in args.batches:
            kv_bytes = 2 * batch * ctx * kv_heads * dim * elem
            if kv_bytes > args.max_pool_gib * (1 << 30):
                continue
            k_cache, v_cache, tables = paged_pool([ctx] * batch, bs, kv_heads, dim, dtype, device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
            call = (q, k_cache, v_cache, tables, lens, dim**-0.5)
            ms = time_ms(partial(paged_decode_attention, *call), args.reps)
            gbps = kv_bytes / ms / 1e6
            share = f"{100 * gbps / peak_gbps:6.1f}%" if peak_gbps else "    n/a"
            ref = "-"
            speedup = "-"
            if kv_bytes <= args.max_ref_gib * (1 << 30):
                ref_ms = time_ms(partial(reference.paged_decode_attention, *call), max(3, args.reps // 4))
                ref, speedup = f"{ref_ms:9.3f}", f"{ref_ms / ms:8.1f}x"
            print(f"{batch:>6} {ctx:>8} {ms:>10.3f} {gbps:>8.0f} {share} {ref:>9} {speedup:>9}")


def bench_prefill(args: argparse.Namespace, peak_tflops: float | None) -> None:
    heads, kv_heads, dim, bs, dtype, device = _shape(args)
    print(f"\nprefill attention (fresh causal prompts): {heads}/{kv_heads} heads, head_dim {dim}, {dtype}")
    columns = ("seqs", 5), ("length", 7), ("triton ms", 10), ("TFLOP/s", 8), ("% peak", 7), ("sdpa ms", 8)
    print(" ".join(f"{name:>{width}}" for name, width in columns), f"{'sdpa/ours':>9}")
    for length in args.prefill_lengths:
        seqs = max(1, args.prefill_tokens // length)
        k_cache, v_cache, tables = paged_pool([length] * seqs, bs, kv_heads, dim, dtype, device)
        q = torch.randn(seqs * length, heads, dim, dtype=dtype, device=device)
        cu = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * length
        lens = torch.full((seqs,), length, dtype=torch.int32, device=device)
        call = (q, k_cache, v_cache, cu, lens, tables, dim**-0.5, length)
        ms = time_ms(partial(paged_prefill_attention, *call), args.reps)
        flops = 4 * heads * dim * seqs * length * (length + 1) / 2
        tflops = flops / ms / 1e9
        share = f"{100 * tflops / peak_tflops:6.1f}%" if peak_tflops else "    n/a"
        # the same shapes, contiguous, through torch's fused attention
        qd = q.view(seqs, length, heads, dim).transpose(1, 2)
        kd = torch.randn(seqs, kv_heads, length, dim, dtype=dtype, device=device)
        vd = torch.randn_like(kd)
        sdpa = partial(
            torch.nn.functional.scaled_dot_product_attention,
            qd,
            kd,
            vd,
            is_causal=True,
            enable_gqa=heads != kv_heads,
        )
        sdpa_ms = time_ms(sdpa, args.reps)
        print(
            f"{seqs:>5} {length:>7} {ms:>10.3f} {tflops:>8.1f} {share} {sdpa_ms:>8.3f} {sdpa_ms / ms:>8.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak bandwidth")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="override the device's peak bf16 TFLOP/s"
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-pool-gib", type=float, default=24.0, help="skip decode shapes with more KV")
    parser.add_argument("--max-ref-gib", type=float, default=4.0, help="torch reference only up to this KV")
    args = parser.parse_args()
    args.contexts = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    args.batches = [1, 4, 16, 64, 256]
    args.prefill_lengths = [512, 1024, 2048, 4096, 8192]
    args.prefill_tokens = 16384
    if args.quick:
        args.contexts, args.batches, args.prefill_lengths = [512, 4096, 32768], [1, 16, 256], [1024, 4096]
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            raise SystemExit("--smoke on CPU needs TRITON_INTERPRET=1 in the environment")
        args.heads, args.kv_heads, args.head_dim, args.reps = 4, 2, 64, 1
        args.contexts, args.batches, args.prefill_lengths, args.prefill_tokens = [100], [2], [64], 128
    elif not torch.cuda.is_available():
        raise SystemExit(
            "bench/kernels.py measures GPU kernels: it needs CUDA (or --smoke with TRITON_INTERPRET=1)"
        )
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    peaks = device_peaks(name)
    peak_gbps = args.peak_gbps or (peaks[0] if peaks else None)
    peak_tflops = args.peak_tflops or (peaks[1] if peaks else None)
    print(
        f"device: {name}; peak {peak_gbps} GB/s, {peak_tflops} bf16 TFLOP/s (data sheet; override with flags)"
    )
    if args.device == "cuda":  # what a plain device-to-device copy reaches, for scale
        buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(buf)
        ms = time_ms(lambda: out.copy_(buf), 10)
        print(f"copy bandwidth (read + write 1 GiB): {2 * buf.numel() / ms / 1e6:.0f} GB/s")
        del buf, out
    bench_decode(args, peak_gbps)
    bench_prefill(args, peak_tflops)


if __name__ == "__main__":
    main()
