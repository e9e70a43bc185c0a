"""Upstreams: the engine pool (own HTTP/1.1 client, the hot path), hosted APIs (the only litellm
import), replica health, and what each backend says its models can do."""
