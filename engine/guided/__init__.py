"""Guided decoding: outputs held to a JSON schema, a regex, a choice list, a grammar or tool-call tags.

bitmask.py   the token bitmask and applying it to logits, before any sampler setting
"""

from engine.guided.bitmask import allocate_bitmask, apply_token_bitmask, bitmask_width

__all__ = ["allocate_bitmask", "apply_token_bitmask", "bitmask_width"]
