"""`python -m engine prepare-model | demo | generate`: the engine's command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from engine.config import EngineConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF folder"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="bytes of KV pool on CPU (default 1 GiB)"
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    parser.add_argument("--seed", type=int, default=0)


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
    )


def _demo(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    config = _config(args)
    llm = LLM(**dataclasses.asdict(config))
    questions = [
        "What is the capital of France?",
        "Write a haiku about paged attention.",
        "Give me three tips for writing clean Python code.",
        "Explain continuous batching in one sentence.",
    ]
    start = time.perf_counter()
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions],
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
    )
    elapsed = time.perf_counter() - start
    for q, out in zip(questions, outs, strict=True):
        print(
            f"\n>>> {q}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
            f"ttft={out.metrics.time_to_first_token or 0:.2f}s]"
        )
    total = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {total} tokens in {elapsed:.1f}s ({total / elapsed:.1f} tok/s)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(_config(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    outs = (
        llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        if args.chat
        else llm.generate(args.prompt, params, use_tqdm=False)
    )
    print(outs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m engine", description="Switchboard inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-model", help="convert the bundled SmolLM2 GGUF into an HF folder (once)")
    demo = sub.add_parser("demo", help="run a few chat prompts through the offline engine")
    _add_engine_options(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    gen = sub.add_parser("generate", help="generate for one prompt")
    _add_engine_options(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "prepare-model":
        from engine.default_model import prepare_default_model

        print(prepare_default_model())
        return 0
    try:
        return _demo(args) if args.command == "demo" else _generate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
