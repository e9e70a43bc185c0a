"""Upstreams: the engine pool (aiohttp, the hot path), hosted APIs (the only litellm import), health."""
