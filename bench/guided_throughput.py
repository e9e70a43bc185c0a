"""What guided decoding costs the engine: the same seeded workload with half the requests under a JSON
schema against none, at batch 32; and what a schema costs to compile, cold and cached.

Usage: nice -n 10 python bench/guided_throughput.py [--model default|DIR] [--batch 32] [--max-tokens 64]
       [--rounds 3] [--seed 0]

Workload: `--batch` requests of 40-80 random prompt tokens, admitted at once (max_num_seqs = batch),
sampled at temperature 0.8 / top_p 0.95 with a seed each, ignore_eos, `--max-tokens` each; the
prefix cache is off, so every round does the same work. Guided requests follow a schema of records
(integer, bounded string, enum, number) with minItems 64: it cannot end before max_tokens, so both
workloads run the same steps and generate the same number of tokens.
Paired steps: two engines of the same model, one per workload, step in turn (which goes first
alternates), each step timed alone, so that load from other processes on a shared machine falls on
both alike. Each step counts with its best time over the rounds (other processes only ever slow a
step down); also printed: the median over all paired steps of guided / unguided step time, and, for
a guided decode step, the time of the mask (fill + apply) and of the matchers' accepts. The schema is
compiled before the timed steps; compile times: the engine's first compile (its view of the
vocabulary is built then), fresh schemas (cold), and the same spec again (cached).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.guided import GuidedMatcher, GuidedSpec
from engine.sampler import Sampler

RECORDS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 12},
                    "status": {"enum": ["active", "inactive", "banned"]},
                    "score": {"type": "number"},
                },
                "required": ["id", "name", "status", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
# a typical response_format schema: nested object, array of objects, enum, bounds, required fields
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "item": {"type": "string"}},
                "required": ["id", "item"],
            },
        },
    },
    "required": ["name", "age", "status", "address", "orders"],
}


class Timers:
    """Seconds spent in the sampler's grammar mask and in the matchers' accepts, wrapped in place."""

    def __init__(self) -> None:
        self.mask = 0.0
        self.accept = 0.0
        self.guided_steps = 0
        apply: Callable[..., None] = Sampler._apply_grammars
        accept: Callable[..., bool] = GuidedMatcher.accept_token
        timers = self

        def timed_apply(sampler: Sampler, logits: Any, seqs: list[Any]) -> None:
            begin = time.perf_counter()
            apply(sampler, logits, seqs)
            if any(s.guided is not None for s in seqs):
                timers.mask += time.perf_counter() - begin
                timers.guided_steps += 1

        def timed_accept(matcher: GuidedMatcher, token: int) -> bool:
            begin = time.perf_counter()
            try:
                return accept(matcher, token)
            finally:
                timers.accept += time.perf_counter() - begin

        Sampler._apply_grammars = timed_apply  # type: ignore[method-assign,assignment]
        GuidedMatcher.accept_token = timed_accept  # type: ignore[method-assign,assignment]

    def reset(self) -> None:
        self.mask = self.accept = 0.0
        self.guided_steps = 0


def workload(n: int, seed: int, max_tokens: int, half: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """The same prompts and seeds either way; with `half`, every other request is under the schema."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(40, 80))] for _ in range(n)]
    schema = StructuredOutputsParams(json=RECORDS)
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.95,
            seed=seed * 1000 + i,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=schema if half and i % 2 == 0 else None,
        )
        for i in range(n)
    ]
    return prompts, params


def add(llm: LLM, tag: str, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Queue one batch; the constraint compiles here (cached after the first round), before the steps."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        llm.engine.add_request(f"{tag}-{i}", prompt, p)


@dataclass
class Step:
    """One engine step of a round: its time, new tokens, and the guided work inside it."""

    seconds: float
    tokens: int
    mask: float
    accept: float


def paired_steps(engines: dict[str, LLM], timers: Timers) -> dict[str, list[Step]]:
    """Step every engine in turn until all are done; each step timed alone."""
    steps: dict[str, list[Step]] = {name: [] for name in engines}
    order = list(engines)
    while any(llm.engine.has_unfinished_requests() for llm in engines.values()):
        for name in order:
            engine = engines[name].engine
            if not engine.has_unfinished_requests():
                continue
            timers.reset()
            begin = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - begin
            tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
            steps[name].append(Step(seconds, tokens, timers.mask, timers.accept))
        order.reverse()  # whoever went first goes second next time
    return steps


def compile_times(llm: LLM, repeats: int) -> dict[str, float]:
    """ms: the engine's first compile (vocabulary view included), cold and cached compiles."""
    inputs = llm.engine.inputs
    first = GuidedSpec.json_object()
    begin = time.perf_counter()
    inputs.compiler(first).compile(first)
    out = {"first compile (any JSON object, builds the vocabulary view)": (time.perf_counter() - begin) * 1e3}
    for name, schema in (("nested schema", PERSON), ("records schema", RECORDS)):
        cold = []
        for i in range(repeats):
            spec = GuidedSpec.json_schema({**schema, "title": f"fresh-{i}"})  # a new cache key each time
            begin = time.perf_counter()
            inputs.compiler(spec).compile(spec)
            cold.append(time.perf_counter() - begin)
        cached = []
        for _ in range(repeats * 20):
            begin = time.perf_counter()
            inputs.compiler(spec).compile(spec)
            cached.append(time.perf_counter() - begin)
        out[f"{name}: cold (median of {repeats})"] = statistics.median(cold) * 1e3
        out[f"{name}: cached (median of {repeats * 20})"] = statistics.median(cached) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    options: dict[str, Any] = dict(max_num_seqs=args.batch, enable_prefix_caching=False, max_model_len=512)
    engines = {"none": LLM(args.model, **options), "half": LLM(args.model, **options)}
    for name, ms in compile_times(engines["half"], repeats=5).items():
        print(f"compile {name}: {ms:.3f} ms")
    timers = Timers()
    for name, llm in engines.items():  # first-call costs (kernels, the fill threads) out of the way
        add(llm, "warm", *workload(4, args.seed + 1, 4, half=name == "half"))
    paired_steps(engines, timers)

    rounds: list[dict[str, list[Step]]] = []
    for r in range(args.rounds):  # the same workload every round: steps line up across rounds
        for name, llm in engines.items():
            add(llm, f"r{r}", *workload(args.batch, args.seed, args.max_tokens, half=name == "half"))
        rounds.append(paired_steps(engines, timers))
        for name, steps in rounds[-1].items():
            seconds, tokens = sum(x.seconds for x in steps), sum(x.tokens for x in steps)
            print(
                f"round {r + 1} {name:>4}: {seconds:6.2f} s in {len(steps)} steps, {tokens} tokens, "
                f"{tokens / seconds:6.1f} tok/s; mask {sum(x.mask for x in steps) * 1e3:.1f} ms, "
                f"accept {sum(x.accept for x in steps) * 1e3:.1f} ms"
            )
    report(args, rounds)


def report(args: argparse.Namespace, rounds: list[dict[str, list[Step]]]) -> None:
    """Best of the rounds per step (other processes only ever slow a step down), summed; and the
    median over every paired step of guided time / unguided time."""
    tokens = {name: sum(x.tokens for x in steps) for name, steps in rounds[0].items()}
    assert tokens["none"] == tokens["half"], tokens
    best = {
        name: [min(r[name][i].seconds for r in rounds) for i in range(len(rounds[0][name]))]
        for name in ("none", "half")
    }
    t_none, t_half = sum(best["none"]), sum(best["half"])
    ratios = [h.seconds / n.seconds for r in rounds for n, h in zip(r["none"], r["half"], strict=True)]
    guided = [x for r in rounds for x in r["half"]]
    mask = statistics.median(x.mask for x in guided[1:])  # the first step is the prefill
    accept = statistics.median(x.accept for x in guided[1:])
    step = statistics.median(x.seconds for x in guided[1:])
    tp_none, tp_half = tokens["none"] / t_none, tokens["half"] / t_half
    print(f"\nbatch {args.batch}, {args.max_tokens} tokens each, best of {args.rounds} rounds per step:")
    print(f"  no guided requests:   {tp_none:7.1f} tok/s ({t_none:.2f} s of steps)")
    print(f"  half under a schema:  {tp_half:7.1f} tok/s ({t_half:.2f} s of steps)")
    print(f"  cost: {(1 - tp_half / tp_none) * 100:+.1f}% throughput (half/none = {tp_half / tp_none:.3f})")
    print(f"  median paired step, guided / unguided: {statistics.median(ratios):.3f}")
    print(
        f"  a guided decode step (median): {step * 1e3:.0f} ms, of which mask (fill + apply) "
        f"{mask * 1e3:.2f} ms and accepts {accept * 1e3:.2f} ms ({(mask + accept) / step * 100:.2f}%)"
    )


if __name__ == "__main__":
    main()
