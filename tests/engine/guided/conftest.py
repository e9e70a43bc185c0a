"""A tokenizer for the guided-decoding tests: the default model's when it is on disk, else a tiny
byte-level BPE trained here (same code paths: llguidance reads both through one interface)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llguidance import LLTokenizer
from llguidance.hf import from_tokenizer

from engine.default_model import default_model_dir
from engine.guided import GuidedCompiler


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    folder = default_model_dir()
    if (folder / "tokenizer.json").is_file():
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(folder)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "alan.turing@enigma.com", "positive neutral"]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    fast: Any = PreTrainedTokenizerFast  # untyped in transformers 5
    return fast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def lltokenizer(hf_tokenizer: Any) -> LLTokenizer:
    """llguidance's view of it, built once (~2 s for 49k tokens); compilers accept it as is."""
    return from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer) + 32, eos_token=[hf_tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def compiler(hf_tokenizer: Any, lltokenizer: LLTokenizer) -> Iterator[GuidedCompiler]:
    # logits one word wider than the vocabulary, as a model with a padded embedding has
    compiler = GuidedCompiler(lltokenizer, len(hf_tokenizer) + 32, [hf_tokenizer.eos_token_id])
    yield compiler
    compiler.close()
