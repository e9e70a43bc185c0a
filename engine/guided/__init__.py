"""Guided decoding: outputs held to a JSON schema, a regex, a choice list, a grammar or tool-call tags.

spec.py      GuidedSpec: what a request asks for, checked at the boundary (response_format,
             vLLM's structured_outputs)
compiler.py  GuidedCompiler: specs -> compiled grammars on a thread pool, LRU-cached by spec
matcher.py   CompiledGrammar, GuidedMatcher (one sequence's grammar state), BitmaskFiller
bitmask.py   the token bitmask and applying it to logits, before any sampler setting
errors.py    GuidedDecodingError: the 400 that says why
"""

from engine.guided.bitmask import allocate_bitmask, apply_token_bitmask, bitmask_width
from engine.guided.compiler import GuidedCompiler
from engine.guided.errors import GuidedDecodingError
from engine.guided.matcher import BitmaskFiller, CompiledGrammar, GuidedMatcher
from engine.guided.spec import GuidedSpec, from_response_format, from_structured_outputs

__all__ = [
    "BitmaskFiller",
    "CompiledGrammar",
    "GuidedCompiler",
    "GuidedDecodingError",
    "GuidedMatcher",
    "GuidedSpec",
    "allocate_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
    "from_response_format",
    "from_structured_outputs",
]
