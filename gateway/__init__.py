"""Switchboard's AI gateway (OpenAI-style endpoint, keys, routing, costs): built in later issues."""
