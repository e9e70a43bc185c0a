"""Speculative decoding: proposals (prompt lookup), their verification in one target pass, stats."""

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.speculator import SpecDecodeStats, Speculator

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "Speculator"]
