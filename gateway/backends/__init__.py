"""Upstreams: the engine pool (own HTTP/1.1 client: the hot path), hosted APIs (via litellm), health,
and what each backend says its models can do."""
