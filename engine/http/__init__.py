"""The engine's HTTP layer (as vLLM's entrypoints/openai): the OpenAI-compatible server and its
limits, request schemas, serving on top of AsyncLLMEngine, OpenAI response shapes, the one error
mapping, and tracing. Nothing below it (the engine core) imports it."""
