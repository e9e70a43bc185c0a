"""Batch invariance stands on row-invariant products: MKL's strict mode is asked for before MKL's
first call, the products are probed, and an engine that cannot have them says so instead of
claiming bit-identical batching."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.layers import cpu_blas
from kernels.reference import ROW_MULTIPLE

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys, torch, torch.nn.functional as F
from engine.layers.cpu_blas import request_strict_mkl, rows_are_invariant
if sys.argv[1] == "late":  # MKL runs before the engine asks: the mode is fixed by then
    F.linear(torch.randn(4, 8), torch.randn(8, 8))
print(request_strict_mkl(), rows_are_invariant(torch.float32, 576, 4))  # the engine pads rows to 4s
"""


def _probe(when: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, when],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_asked_first_mkl_turns_strict_and_every_row_gets_the_same_bits() -> None:
    assert _probe("first") == ["True", "True"]
    strict_late, _ = _probe("late")
    assert strict_late == "False"  # too late: MKL keeps the mode of its first call


def test_an_engine_without_row_invariant_products_serves_and_says_it_is_not_batch_invariant(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_blas, "rows_are_invariant", lambda dtype, width, multiple: False)
    with caplog.at_level(logging.WARNING, logger="engine.layers.cpu_blas"):
        llm = LLM(str(tiny_model_factory("llama")), max_model_len=128)
    assert llm.engine.runner.precision()["batch_invariant"] is False
    assert "batch invariance is off" in caplog.text
    assert llm.engine.runner.backend.chunked_logits is False  # the fast kernels, as when asked off


def test_an_engine_with_row_invariant_products_is_batch_invariant(
    tiny_model_factory: Callable[..., Path],
) -> None:
    assert cpu_blas.rows_are_invariant(torch.float32, 64, ROW_MULTIPLE)  # tests/conftest.py asked MKL first
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128)
    assert llm.engine.runner.precision()["batch_invariant"] is True
