"""Switchboard's self-hosted inference engine."""

from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError, KVCacheCapacityError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContextLengthExceededError",
    "EngineConfig",
    "InvalidRequestError",
    "KVCacheCapacityError",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
