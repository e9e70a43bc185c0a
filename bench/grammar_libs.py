"""Grammar libraries for guided decoding, measured on this CPU: compile time and per-step mask time.

Usage: nice -n 10 python bench/grammar_libs.py [--model DIR] [--libs xgrammar,llguidance,outlines-core]
       [--steps N] [--threads N]

Per library that imports, with the model folder's tokenizer (vocab = the model's logits width):
- compile: cold (no cache) / cold + the first mask (lazy libraries build lexer states then) / cached
  (a matcher from the cached compile + its first mask), for (a) a nested JSON schema (nested object,
  array of objects, enum, required fields, bounded integer, strings), (b) any JSON object, (c) a
  regex, (d) a choice list; and a 40-object schema compiled on a thread beside ~20 us Python steps
  (the worst step = how long a step loop beside a compile could be held up: GIL or cores);
- mask: one pass of a fresh compile along a valid answer (a new schema's first request); then per
  step at batch 1 and 64, rows at staggered positions of a valid answer (real mid-answer states):
  fill every row of one int32 bitmask (a loop, and the library's batch call), accept each row's token.
Applying the bitmask to float32 logits [batch, vocab] does not depend on the library (one bitmask
layout for all three): timed once, engine/guided's torch apply against xgrammar's CPU kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.default_model import default_model_dir
from engine.guided.bitmask import apply_token_bitmask, bitmask_width

MODEL = default_model_dir()  # where `make model` put the converted default model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "item": {"type": "string"}},
                "required": ["id", "item"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "status", "address", "orders"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "status": "active",
    "address": {"street": "12 St James's Square", "city": "London"},
    "orders": [{"id": 1, "item": "Analytical Engine"}, {"id": 22, "item": "punched cards"}],
}
REGEX = r"[a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,10}\.(com|org|net)"
COMPACT = (",", ":")  # the answers' layout; each library allows whitespace (its default, and vLLM's)
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]


def _big_schema(n: int) -> dict[str, Any]:
    """n nested objects (pattern, bounded integer, 20-value enum): a large schema, for the stall figure."""
    inner = {"a": {"type": "string", "pattern": "^[a-z]{3,9}$"}, "c": {"enum": [f"v{j}" for j in range(20)]}}
    props = {
        f"f{i}": {"type": "object", "properties": inner | {"b": {"type": "integer", "maximum": 9 * i}}}
        for i in range(n)
    }
    return {"type": "object", "properties": props, "required": list(props)}


BIG = _big_schema(40)
CASES: dict[str, tuple[str, Any]] = {
    "json schema (nested)": ("schema", SCHEMA),
    "json_object (any)": ("object", None),
    "regex": ("regex", REGEX),
    "choice (4)": ("choice", CHOICES),
}


def ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


class XGrammarLib:
    """xgrammar: compiled grammars are shareable; matchers are cheap; a batch fill runs on threads."""

    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import xgrammar as xg

        self.xg = xg
        self.info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.batch = xg.BatchGrammarMatcher(max_threads=threads)
        self.threads = threads  # compile threads too (its default, 8, starves the step loop on 2 cores)
        self.cached = xg.GrammarCompiler(self.info, max_threads=threads)

    def compile(self, kind: str, payload: Any, cache: bool = False) -> Any:
        fresh = self.xg.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        compiler = self.cached if cache else fresh
        if kind == "schema":
            return compiler.compile_json_schema(json.dumps(payload))
        if kind == "object":
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(payload)
        return compiler.compile_regex("(" + "|".join(payload) + ")")

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms_: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms_, bitmask)


class LLGuidanceLib:
    """llguidance: a grammar string builds a matcher (lazily); a template matcher is copied per request."""

    name = "llguidance"

    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance  # not llguidance.torch: importing it costs ~3.6 s (torch.compile)
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.templates: dict[tuple[str, str], Any] = {}

    def _grammar(self, kind: str, payload: Any) -> str:
        m = self.llg.LLMatcher
        if kind == "schema":
            return m.grammar_from_json_schema(payload)
        if kind == "object":
            return m.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return m.grammar_from_regex(payload)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in payload))

    def compile(self, kind: str, payload: Any, cache: bool = False) -> Any:
        key = (kind, json.dumps(payload))
        if cache and key in self.templates:
            return self.templates[key]
        matcher = self.llg.LLMatcher(self.tok, self._grammar(kind, payload), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        if cache:
            self.templates[key] = matcher
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask[row]
        m.unsafe_compute_mask_ptr(r.data_ptr(), r.numel() * r.element_size())

    def fill_batch(self, ms_: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(ms_)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )


class OutlinesCoreLib:
    """outlines-core: a regex (JSON schemas go through one) becomes a token-level DFA index."""

    name = "outlines-core"

    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.to_regex = build_regex_from_schema
        self.vocab = outlines_core.Vocabulary(tok.eos_token_id, _byte_vocabulary(tok))
        self.indexes: dict[tuple[str, str], Any] = {}

    def compile(self, kind: str, payload: Any, cache: bool = False) -> Any:
        key = (kind, json.dumps(payload))
        if cache and key in self.indexes:
            return self.indexes[key]
        if kind == "schema":
            regex = self.to_regex(json.dumps(payload))
        elif kind == "object":
            regex = self.to_regex('{"type": "object"}')
        elif kind == "regex":
            regex = payload
        else:
            regex = "(" + "|".join(payload) + ")"
        index = self.oc.Index(regex, self.vocab)
        if cache:
            self.indexes[key] = index
        return index

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def accept(self, m: Any, token: int) -> bool:
        ok = bool(m.accepts_tokens([token]))
        if ok:
            m.advance(token, return_tokens=False)
        return ok

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask[row]
        m.write_mask_into(r.data_ptr(), r.numel(), r.element_size())

    fill_batch = None


def _byte_vocabulary(tok: Any) -> dict[bytes, list[int]]:
    """token bytes -> ids, for a byte-level BPE tokenizer (GPT-2 byte-to-unicode alphabet)."""
    # GPT-2's alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are
    # shifted to chr(256 + k) in byte order
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}
    special = set(tok.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for text, idx in tok.get_vocab().items():
        if idx in special or idx == tok.eos_token_id:
            continue
        out.setdefault(bytes(to_byte[c] for c in text), []).append(idx)
    return out


LIBS: dict[str, Any] = {
    "xgrammar": XGrammarLib,
    "llguidance": LLGuidanceLib,
    "outlines-core": OutlinesCoreLib,
}


def _first_mask(lib: Any, kind: str, payload: Any, bitmask: torch.Tensor, cache: bool) -> None:
    lib.fill(lib.matcher(lib.compile(kind, payload, cache)), bitmask, 0)


def compile_figures(lib: Any, vocab: int, slow: set[str]) -> dict[str, str]:
    """Cold compile / + first mask / cached, per case; a cold compile over 1 s is timed once only
    and its kind goes into `slow` (later figures then start from its cached compile)."""
    out: dict[str, str] = {}
    bitmask = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)
    for label, (kind, payload) in CASES.items():
        try:
            start = time.perf_counter()
            compiled = lib.compile(kind, payload, cache=True)  # a miss: cold, and now cached
            cold = (time.perf_counter() - start) * 1000
            lib.fill(lib.matcher(compiled), bitmask, 0)
            to_mask = (time.perf_counter() - start) * 1000
            if cold > 1000:
                slow.add(kind)
            else:
                cold = ms(partial(lib.compile, kind, payload), 5)
                to_mask = ms(partial(_first_mask, lib, kind, payload, bitmask, False), 5)
            cached = ms(partial(_first_mask, lib, kind, payload, bitmask, True), 20)
            out[label] = f"{cold:.1f} / {to_mask:.1f} / {cached:.2f}"
        except Exception as exc:  # a library that cannot compile a case is a figure, not a crash
            out[label] = f"fails: {str(exc).splitlines()[0][:40]}"
    return out


def mask_figures(lib: Any, tokens: list[int], kind: str, vocab: int, batch: int, steps: int) -> str:
    """Median ms per step: fill (loop) / fill (batch call) / accept, rows advanced along `tokens`."""
    compiled = lib.compile(kind, SCHEMA if kind == "schema" else None, cache=True)
    pos = [(row * 7) % len(tokens) for row in range(batch)]
    matchers = []
    for p in pos:
        m = lib.matcher(compiled)
        for t in tokens[:p]:
            assert lib.accept(m, t), "the answer's tokens must be accepted"
        matchers.append(m)
    bitmask = torch.full((batch, bitmask_width(vocab)), -1, dtype=torch.int32)
    loop_t, batch_t, accept_t = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        for row, m in enumerate(matchers):
            lib.fill(m, bitmask, row)
        loop_t.append((time.perf_counter() - start) * 1000)
        if lib.fill_batch is not None:
            start = time.perf_counter()
            lib.fill_batch(matchers, bitmask)
            batch_t.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        for row, m in enumerate(matchers):
            if pos[row] < len(tokens):
                assert lib.accept(m, tokens[pos[row]])
        accept_t.append((time.perf_counter() - start) * 1000)
        for row in range(batch):  # a finished answer starts again (untimed)
            pos[row] += 1
            if pos[row] > len(tokens):
                matchers[row] = lib.matcher(compiled)
                pos[row] = 0
    fill_batch = f"{statistics.median(batch_t):.2f}" if batch_t else "-"
    return f"{statistics.median(loop_t):.2f} / {fill_batch} / {statistics.median(accept_t):.2f}"


def stall_figure(lib: Any) -> str:
    """Compile BIG on a thread beside ~20 us Python steps: compile ms / worst step ms (the stall)."""
    worker = threading.Thread(target=lib.compile, args=("schema", BIG))
    start = time.perf_counter()
    worker.start()
    worst = 0.0
    while worker.is_alive():
        step = time.perf_counter()
        sum(range(1000))
        worst = max(worst, time.perf_counter() - step)
    worker.join()
    return f"{(time.perf_counter() - start) * 1000:.0f} / {worst * 1000:.1f}"


def first_pass_figures(lib: Any, tokens: list[int], kind: str, vocab: int, slow: set[str]) -> str:
    """Mean / max ms per fill over one pass of a fresh compile: a new schema's first request."""
    matcher = lib.matcher(lib.compile(kind, SCHEMA if kind == "schema" else None, cache=kind in slow))
    bitmask = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)
    times = []
    for t in tokens:
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        times.append((time.perf_counter() - start) * 1000)
        assert lib.accept(matcher, t)
    return f"{statistics.mean(times):.3f} / {max(times):.2f}"


def apply_figures(vocab: int, steps: int) -> dict[str, str]:
    """Applying one bitmask to float32 logits [batch, vocab]: the torch unpack vs xgrammar's kernel."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 64):
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab)), generator=gen)
        bitmask = bitmask.to(torch.int32)
        logits = torch.randn(batch, vocab, generator=gen)
        ours = ms(partial(apply_token_bitmask, logits, bitmask), steps)
        row = f"engine.guided (torch) {ours:.3f}"
        try:
            import xgrammar as xg

            theirs = ms(partial(xg.apply_token_bitmask_inplace, logits, bitmask), steps)
            row += f" / xgrammar CPU kernel {theirs:.3f}"
        except ImportError:
            pass
        out[f"apply, batch {batch} (ms)"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--steps", type=int, default=40, help="mask steps timed per batch size")
    parser.add_argument("--threads", type=int, default=2, help="threads of batch fills and xgrammar compiles")
    args = parser.parse_args()

    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    print(f"tokenizer: {len(tok)} ids (base {tok.vocab_size}); model logits width: {vocab}")
    answer_tokens = tok.encode(json.dumps(ANSWER, separators=COMPACT), add_special_tokens=False)
    object_tokens = tok.encode(
        json.dumps({"a": [1, 2.5, None, True], "b": {"c": "d e"}}, separators=COMPACT),
        add_special_tokens=False,
    )
    print(f"valid answers: schema {len(answer_tokens)} tokens, json_object {len(object_tokens)} tokens")

    columns: dict[str, dict[str, str]] = {}
    totals: dict[str, float] = {}
    for name in args.libs.split(","):
        try:
            start = time.perf_counter()
            lib = LIBS[name](tok, vocab, args.threads)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        col = {"tokenizer setup (ms)": f"{(time.perf_counter() - start) * 1000:.0f}"}
        slow: set[str] = set()
        col.update({f"compile {k} (ms)": v for k, v in compile_figures(lib, vocab, slow).items()})
        # outlines-core's index for BIG would take minutes: its regex DFA grows with every object
        col["compile 40 objects on a thread: ms / stall"] = (
            "-" if lib.name == "outlines-core" else stall_figure(lib)
        )
        answers = {"schema": answer_tokens, "json_object": object_tokens}
        for label, toks in answers.items():
            kind = "schema" if label == "schema" else "object"
            col[f"mask {label}, first pass (ms/token)"] = first_pass_figures(lib, toks, kind, vocab, slow)
        step_ms = 0.0
        for label, toks in answers.items():
            kind = "schema" if label == "schema" else "object"
            for batch, steps in ((1, args.steps * 4), (64, args.steps)):
                figure = mask_figures(lib, toks, kind, vocab, batch, steps)
                col[f"mask {label}, batch {batch} (ms/step)"] = figure
                if kind == "schema":
                    step_ms += min(float(x) for x in figure.split(" / ")[:2] if x != "-")
        columns[lib.name] = col
        totals[lib.name] = step_ms
        print(f"{lib.name}: done", flush=True)

    rows = list(next(iter(columns.values())).keys()) if columns else []
    width = max(len(r) for r in rows) if rows else 0
    print("\ncompile: cold / cold + first mask / cached (matcher + first mask); first pass: mean / max fill;")
    print("mask: fill loop / fill batch call / accept, median per step")
    print(" " * width + " | " + " | ".join(f"{n:^34}" for n in columns))
    for r in rows:
        print(f"{r:<{width}} | " + " | ".join(f"{columns[n].get(r, '-'):^34}" for n in columns))
    for label, figure in apply_figures(vocab, args.steps).items():
        print(f"{label:<{width}} | {figure}")
    if totals:
        best = min(totals.values())
        print("\nschema mask fill, batch 1 + batch 64 (best fill of each), ratio to the fastest:")
        for n, t in totals.items():
            print(f"  {n:<14} {t:8.2f} ms  x{t / best:.1f}")


if __name__ == "__main__":
    main()
