"""Tensor parallelism on the CPU (gloo): greedy tokens equal to one rank's on tiny Llama, Mistral,
Qwen2 and Qwen3 models (Qwen3's one KV head replicated over the ranks), with prefix caching,
chunked prefill and forced preemption; refusals by name; a dead worker fails the step, never hangs."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.parallel.workers import free_port
from engine.planner import weight_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))] for _ in range(count)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    ("arch", "size"),
    [("llama", 2), ("mistral", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 4), ("llama-biased", 2)],
)
def test_greedy_tokens_equal_one_ranks(tiny_model_factory: Callable[..., Path], arch: str, size: int) -> None:
    path = str(tiny_model_factory(arch))
    prompts = _prompts(5)
    expected = _tokens(LLM(path, max_model_len=256), prompts)
    parallel = LLM(path, max_model_len=256, tensor_parallel_size=size)
    assert _tokens(parallel, prompts) == expected
    again = parallel.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits on every rank
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert sum(o.metrics.num_cached_tokens for o in again if o.metrics is not None) > 0
    held = sum(p.numel() * p.element_size() for p in parallel.engine.runner.model.parameters())
    assert weight_bytes(ModelConfig.from_dir(Path(path)), "float32", None, size) == held  # as planned


def test_chunked_prefill_and_preemption_keep_the_tokens(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("llama")
    cfg = ModelConfig.from_dir(path)
    per_block = 2 * cfg.num_layers * 16 * (cfg.num_kv_heads // 2) * cfg.head_dim * 4  # one rank's
    prompts = _prompts(8, seed=1)
    expected = _tokens(LLM(str(path), max_model_len=256), prompts)
    options: dict[str, Any] = dict(max_num_batched_tokens=32, kv_cache_memory=12 * per_block)
    parallel = LLM(str(path), max_model_len=256, tensor_parallel_size=2, **options)
    assert _tokens(parallel, prompts) == expected
    assert parallel.engine.stats().num_preemptions > 0


def test_settings_that_cannot_be_split_are_refused(tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="unquantized checkpoints"):
        LLM(path, tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(path, tensor_parallel_size=0)


def test_a_killed_worker_fails_the_next_step_instead_of_hanging(
    tiny_model_factory: Callable[..., Path],
) -> None:
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=256, tensor_parallel_size=2)
    assert _tokens(llm, _prompts(1))  # the pair works
    (worker,) = llm.engine._workers
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 70  # the collective timeout bounds it


def test_two_nodes_by_torchruns_variables(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 runs `python -m engine worker`, node 0 the engine: here both on the loopback."""
    path = str(tiny_model_factory("qwen2"))
    prompts = _prompts(3, seed=4)
    expected = _tokens(LLM(path, max_model_len=256), prompts)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2"}
    command = [sys.executable, "-m", "engine", "worker", "--model", path, "--tensor-parallel-size", "2",
               "--max-model-len", "256"]  # fmt: skip
    node1 = subprocess.Popen(command, env={**os.environ, **env, "NODE_RANK": "1"})
    try:
        for name, value in {**env, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        parallel = LLM(path, max_model_len=256, tensor_parallel_size=2)
        assert parallel.engine._workers == []  # this node's only rank is the engine's own
        assert _tokens(parallel, prompts) == expected
        parallel.engine.close()
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_hung_worker_fails_the_step_within_the_distributed_timeout(
    tiny_model_factory: Callable[..., Path],
) -> None:
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, max_model_len=256, tensor_parallel_size=2, distributed_timeout=3)
    assert _tokens(llm, _prompts(1))
    (worker,) = llm.engine._workers
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(_prompts(1), GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 15
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)


def test_speculative_decoding_under_tensor_parallelism(tiny_model_factory: Callable[..., Path]) -> None:
    """Verify passes (drafts after the last token) go to every rank like any other step."""
    path = str(tiny_model_factory("llama"))
    rng = random.Random(5)
    phrases = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(3)]
    prompts = [p * 4 for p in phrases]  # prompt lookup finds something to propose
    expected = _tokens(LLM(path, max_model_len=256), prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "min_acceptance_rate": 0.0}  # fmt: skip
    parallel = LLM(path, max_model_len=256, tensor_parallel_size=2, speculative_config=spec)
    assert _tokens(parallel, prompts) == expected
    assert parallel.engine.speculator is not None and parallel.engine.speculator.stats().num_drafts > 0
    parallel.engine.close()


def test_an_engine_idle_past_the_distributed_timeout_still_serves(
    tiny_model_factory: Callable[..., Path],
) -> None:
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, max_model_len=256, tensor_parallel_size=2, distributed_timeout=3)
    first = _tokens(llm, _prompts(1))
    time.sleep(4.5)  # the workers wait for the next step longer than any collective may take
    assert _tokens(llm, _prompts(1)) == first
    (worker,) = llm.engine._workers
    assert worker.is_alive()


_DRIVER = """
import sys, time
from engine import LLM
llm = LLM(sys.argv[1], max_model_len=256, tensor_parallel_size=2)
print(llm.engine._workers[0].pid, flush=True)
time.sleep(120)
"""


def test_workers_exit_when_their_engine_is_killed(tiny_model_factory: Callable[..., Path]) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(tiny_model_factory("llama"))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None
        worker = int(driver.stdout.readline())
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # an exited child not yet reaped by its (gone) parent
        return f.read().split(")")[-1].split()[0] != "Z"
