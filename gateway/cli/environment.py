"""What `python -m gateway` adds to its own environment, before anything imports litellm or tiktoken.

Both libraries read the environment, not an argument: litellm fetches its cost map from the network
when it is imported unless LITELLM_LOCAL_MODEL_COST_MAP is true, and tiktoken downloads its BPE
files unless TIKTOKEN_CACHE_DIR names a folder that holds them (litellm's package bundles them).
Library modules never write the environment; the entry point (gateway/__main__.py) sets these
defaults once, and the processes it starts (uvicorn workers, `gateway dev`'s children) inherit them.
A program that embeds `create_app` sets them itself (the tests' conftest does).
"""

from __future__ import annotations

from gateway.governance.costs import litellm_file


def offline_defaults() -> dict[str, str]:
    """The variables to set where the environment does not set them already."""
    defaults = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    bundled = litellm_file("litellm_core_utils", "tokenizers")
    if bundled is not None:
        defaults["TIKTOKEN_CACHE_DIR"] = str(bundled)
    return defaults
