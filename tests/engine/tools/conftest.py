"""The guided-decoding tests' tokenizer and compiler, shared (built once per session)."""

from tests.engine.guided.conftest import compiler, hf_tokenizer, lltokenizer

__all__ = ["compiler", "hf_tokenizer", "lltokenizer"]
