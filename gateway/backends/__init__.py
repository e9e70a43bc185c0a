"""Upstreams: the self-hosted engine pool (httpx, the hot path)."""
