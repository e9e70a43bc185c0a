"""The default model (SmolLM2-135M-Instruct) rewrites its own paragraph token for token alike with
and without prompt-lookup speculation, and most drafts of the text it copies are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams


@pytest.mark.slow
def test_default_model_greedy_rewrite_is_identical_and_mostly_accepted(default_model_dir: Path) -> None:
    options = dict(kv_cache_memory=64 << 20, max_model_len=1024)
    plain = LLM(str(default_model_dir), **options)
    ask = [[{"role": "user", "content": "Write a short paragraph about the water cycle."}]]
    paragraph = plain.chat(ask, SamplingParams(temperature=0, max_tokens=56), use_tqdm=False)[0]
    rewrite = "Rewrite the following paragraph, keeping its wording but fixing any mistakes:\n\n"
    messages = [[{"role": "user", "content": rewrite + paragraph.outputs[0].text.strip()}]]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.outputs[0].token_ids for o in plain.chat(messages, params, use_tqdm=False)]
    del plain
    spec = LLM(str(default_model_dir), **options, speculative_config={"method": "ngram"})
    assert [o.outputs[0].token_ids for o in spec.chat(messages, params, use_tqdm=False)] == expected
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert stats.acceptance_rate is not None and stats.acceptance_rate > 0.6
