"""Switchboard's AI gateway: one OpenAI-style endpoint in front of the self-hosted engine and hosted APIs.

Rooms, lowest floor first; a module imports only from its own room or the floors below it
(docs/architecture.md walks a request through them):
config, store < governance, backends < routing < telemetry < pipeline < api < console < cli < main.py
(the composition root). `gateway/errors.py` (the base error type) sits under every floor.
"""
