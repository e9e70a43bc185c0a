"""`python -m engine prepare-model | serve | demo | generate | eval | plan`: the engine's command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from engine.config import CHECKPOINT_QUANTIZATIONS, QUANTIZATIONS, EngineConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF folder"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length; unset: the model's")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="bytes of KV pool on CPU; unset: 1 GiB"
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory the engine may use (CUDA only)",
    )
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda[:N]'")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads; unset: torch's choice"
    )
    parser.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="allow results to depend on batch composition (slightly faster)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="kernels: auto = Triton on CUDA, the torch references on CPU; triton on CPU needs "
        "TRITON_INTERPRET=1 (slow, for testing)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="never capture CUDA graphs for decode steps"
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=[*QUANTIZATIONS, *CHECKPOINT_QUANTIZATIONS],
        help="quantize at load time: int8 = weights with one scale per output channel; int4 = "
        "groups of 32 inputs, LM head in int8; w8a8 = int8 weights and int8 activations (a scale "
        "per row), fastest for batches on the CPU. A pre-quantized checkpoint (awq, gptq, fp8, "
        "compressed-tensors) is found from its config.json; naming its method only checks it",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8", "fp8_e4m3"],
        help="KV pool storage: auto = the model's dtype; int8 / fp8_e4m3 (fp8) = codes with a scale per "
        "token and KV head (about 2x the blocks of bfloat16, 3.9x float32)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model and its KV cache over N ranks, one process each (gloo on CPU, NCCL on CUDA)",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds a tensor-parallel rank waits in a collective before the engine gives up",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON with vLLM\'s names: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (prompt lookup); unset: off',
    )
    parser.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling draws from it)")
    caps = parser.add_argument_group("per-request caps (HTTP 400 naming the parameter when exceeded)")
    caps.add_argument("--max-prompts", type=int, default=32, help="prompts in one /v1/completions list")
    caps.add_argument("--max-n", type=int, default=16, help="completions per prompt (n)")
    caps.add_argument("--max-choices", type=int, default=128, help="prompts x n in one request")
    caps.add_argument("--max-stop-strings", type=int, default=16, help="entries in stop")
    caps.add_argument("--max-stop-string-len", type=int, default=256, help="characters in one stop string")
    caps.add_argument(
        "--max-logprobs", type=int, default=20, help="top_logprobs (chat) and logprobs (completions), <= 20"
    )
    caps.add_argument(
        "--max-guided-bytes",
        type=int,
        default=65536,
        help="bytes of a guided-decoding JSON schema, grammar or structural tag",
    )
    caps.add_argument("--max-guided-choices", type=int, default=256, help="entries in a guided choice list")
    caps.add_argument("--max-guided-regex-len", type=int, default=4096, help="characters in a guided regex")
    parser.add_argument(
        "--max-consecutive-step-failures",
        type=int,
        default=3,
        help="failed steps in a row after which the engine gives up and the server exits non-zero",
    )


# flags whose meaning is the negation of an EngineConfig field
_NEGATED = {"no_prefix_caching": "enable_prefix_caching", "no_batch_invariant": "batch_invariant"}


def _given_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tail: list[str]
) -> dict[str, object]:
    """EngineConfig fields set on the command line `tail` (a flag given its default value too)."""
    unset = object()
    # argparse fills in only the defaults a namespace lacks: what stays `unset` was not on the line
    seen = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    parser.parse_known_args(tail, seen)
    fields = EngineConfig.field_names()
    given: dict[str, object] = {}
    for action in parser._actions:
        name = action.dest
        if getattr(seen, name) is unset:
            continue
        value = getattr(args, name)
        if name in _NEGATED:
            given[_NEGATED[name]] = not value
        elif name in fields:
            given[name] = value
    return given


def _config(args: argparse.Namespace) -> EngineConfig:
    """Command-line flags, over SWITCHBOARD_ENGINE_<NAME> variables, over EngineConfig's defaults."""
    return EngineConfig.from_env(**args.engine_options)


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


def _eval(args: argparse.Namespace) -> int:
    from engine import LLM
    from engine.evaluate import evaluate, report, setting_name

    config = _config(args)
    options = dataclasses.asdict(config) | {"enable_prefix_caching": False}
    full = options | {"quantization": None, "kv_cache_dtype": "auto"}
    measure = (args.text_tokens, args.window, args.new_tokens, args.prompts)
    if args.baseline or full == options:
        print(report("full precision", evaluate(LLM(**full), *measure), None))
        return 0
    base = evaluate(LLM(**full), *measure)
    tested = evaluate(LLM(**options), *measure, reference=base)
    print(report(setting_name(config), tested, base))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from engine.default_model import resolve_model
    from engine.llm_engine import resolve_max_model_len
    from engine.models.config import ModelConfig
    from engine.parallel.workers import run_node

    config = _config(args)
    model_dir = resolve_model(config.model)
    return run_node(config, model_dir, resolve_max_model_len(config, ModelConfig.from_dir(model_dir)))


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


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients pass as 'model' (default: the model folder's name and the --model value)",
    )
    parser.add_argument(
        "--health-stall-timeout",
        type=float,
        default=30.0,
        help="seconds without step-loop progress after which /health answers 503",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds requests in flight may take to finish before they are aborted",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (unset: $SWITCHBOARD_ENGINE_API_KEY, else open)",
    )
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    http = parser.add_argument_group(
        "HTTP limits (each also read from SWITCHBOARD_ENGINE_<NAME>, e.g. SWITCHBOARD_ENGINE_MAX_BODY_BYTES)"
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env("max_body_bytes", int, None),
        help="request body limit, checked before parsing (413); unset: max(2 MiB, 32 x max_model_len)",
    )
    http.add_argument(
        "--max-header-bytes",
        type=int,
        default=_env("max_header_bytes", int, 32 * 1024),
        help="request line + headers limit (431)",
    )
    http.add_argument(
        "--header-read-timeout",
        type=float,
        default=_env("header_read_timeout", float, 10.0),
        help="seconds a client may take to send its request head; then the connection is closed",
    )
    http.add_argument(
        "--body-read-timeout",
        type=float,
        default=_env("body_read_timeout", float, 30.0),
        help="seconds a client may take to send its body after the head (408)",
    )
    http.add_argument(
        "--send-timeout",
        type=float,
        default=_env("send_timeout", float, 120.0),
        help="seconds a client may take no bytes of an answer the server is writing; then the "
        "connection is aborted (and its request with it)",
    )
    http.add_argument(
        "--limit-concurrency",
        type=int,
        default=_env("limit_concurrency", int, 1024),
        help="requests in progress; past it, 503 (connections: twice it; 0: unlimited)",
    )
    http.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=_env("timeout_keep_alive", int, 75),
        help="seconds an idle keep-alive connection stays open (keep it above the gateway's 60)",
    )
    http.add_argument(
        "--timeout-graceful-shutdown",
        type=int,
        default=_env("timeout_graceful_shutdown", int, 5),
        help="after draining, seconds open connections get before they are closed",
    )


def _env(name: str, kind: type[int] | type[float], fallback: float | None) -> float | None:
    """An HTTP limit's default from SWITCHBOARD_ENGINE_<NAME>, else `fallback`."""
    raw = os.environ.get(f"SWITCHBOARD_ENGINE_{name.upper()}")
    if raw is None or not raw.strip():
        return fallback
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"error: SWITCHBOARD_ENGINE_{name.upper()} must be a number, got {raw!r}") from None


def serve(args: argparse.Namespace, **server_kwargs: Any) -> int:
    """`serve`: run the HTTP server (`server_kwargs` go to `run_server`, e.g. an engine class)."""
    from engine.http.limits import HTTPLimits
    from engine.http.server import ServerOptions, run_server
    from engine.preflight import check_startable

    limits = HTTPLimits(
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout,
        send_timeout=args.send_timeout,
        limit_concurrency=args.limit_concurrency or None,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    options = ServerOptions(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        stall_timeout=args.health_stall_timeout,
        shutdown_timeout=args.shutdown_timeout,
        api_key=args.api_key or os.environ.get("SWITCHBOARD_ENGINE_API_KEY") or None,
        access_log=not args.no_access_log,
        log_level=args.log_level,
        otlp_traces_endpoint=otlp_traces_endpoint(os.environ),
        otel_service_name=os.environ.get("OTEL_SERVICE_NAME") or "switchboard-engine",
        limits=limits,
    )
    check_startable(config := _config(args))  # before the server listens: one that cannot load is exit 2
    return run_server(config, options, **server_kwargs)


def otlp_traces_endpoint(environ: Mapping[str, str]) -> str | None:
    """OpenTelemetry's own variables: the traces URL, else the base URL + /v1/traces; None: no tracing."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `engine_options`: the EngineConfig fields given as flags."""
    parser = argparse.ArgumentParser(prog="python -m engine", description="Switchboard inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-model", help="convert the bundled SmolLM2 GGUF into an HF folder (once)")
    demo = sub.add_parser("demo", help="run a few chat prompts through the offline engine")
    _add_engine_options(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat, completions, models, health, metrics)",
        description="Serve the model over an OpenAI-compatible HTTP API with continuous batching.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_engine_options(serve)
    _add_server_options(serve)
    gen = sub.add_parser("generate", help="generate for one prompt")
    _add_engine_options(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    evaluate = sub.add_parser(
        "eval",
        help="a precision setting's quality beside full precision: perplexity, greedy agreement, tasks",
    )
    _add_engine_options(evaluate)
    evaluate.add_argument("--baseline", action="store_true", help="evaluate full precision alone")
    evaluate.add_argument("--text-tokens", type=int, default=8192, help="tokens of text for perplexity")
    evaluate.add_argument("--window", type=int, default=512, help="tokens scored per prefill")
    evaluate.add_argument("--prompts", type=int, default=16, help="prompts for greedy agreement (<= 16)")
    evaluate.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    worker = sub.add_parser(
        "worker",
        help="a node's tensor-parallel ranks, for an engine on another node (torchrun's variables)",
        description="Run this node's ranks of a tensor-parallel engine whose rank 0 (`serve`) runs on "
        "NODE_RANK 0: MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK as torchrun sets them, and the "
        "same engine options as the engine's.",
    )
    _add_engine_options(worker)
    from engine.planner import add_arguments as add_plan_arguments

    plan = sub.add_parser(
        "plan",
        help="what a model needs on a GPU or CPU: weights, KV per token, sequences that fit",
        description="Plan capacity before starting: weights per device, KV bytes per token, KV blocks "
        "and tokens, concurrent sequences per context length, a suggested max_num_seqs.",
    )
    add_plan_arguments(plan)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    commands = {"demo": demo, "serve": serve, "generate": gen, "eval": evaluate, "worker": worker}
    if args.command in commands:  # the command is argv's first word: the top parser has no options
        args.engine_options = _given_options(commands[args.command], args, argv[1:])
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "no_batch_invariant", True):  # before anything calls MKL (engine/layers/cpu_blas.py)
        from engine.layers.cpu_blas import request_strict_mkl

        request_strict_mkl()
    if args.command == "plan":
        from engine.planner import run

        return run(args)
    if args.command == "prepare-model":
        from engine.default_model import prepare_default_model
        from engine.tokenizer import load_tokenizer

        folder = prepare_default_model()
        load_tokenizer(folder)  # decides (and remembers) its tokenizer class: later starts skip that
        print(folder)
        return 0
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "worker":
            return _worker(args)
        return _demo(args) if args.command == "demo" else _generate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
