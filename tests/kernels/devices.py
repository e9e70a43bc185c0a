"""Where kernel tests run: the CPU interpreter (fp32, fp16) without CUDA, the GPU with it."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ON_CPU = pytest.mark.skipif(CUDA, reason="the Triton interpreter is off when CUDA is present")
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
# (device, dtype); the interpreter computes bf16 wrongly, so bf16 runs on CUDA only
TARGETS = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=ON_CPU),
    pytest.param("cpu", torch.float16, id="cpu-fp16", marks=ON_CPU),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=ON_GPU),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=ON_GPU),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=ON_GPU),
]
