"""The engine server with test hooks: `python -m tests.engine.hooked_server serve --model ... [options]`.

Tests that need a stuck or failing step start this instead of `python -m engine serve`; the shipped
engine has no such hooks. It serves `HookedAsyncLLMEngine` and adds two routes:
`POST /debug/stall {"seconds": x}` hangs the step loop, `POST /debug/fail-steps {"steps": n}` makes
the next steps raise (as a device error would), `POST /debug/step-delay {"seconds": x}` makes every
step take x longer (a tiny model streaming at a big model's pace, to be cut mid-answer), and
`GET /debug/in-flight` says how many requests it holds (from their admission, before any step).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from fastapi import FastAPI, Request, Response

from engine.__main__ import parse_args, serve
from engine.async_engine import AsyncLLMEngine
from engine.http.openai_format import dumps
from engine.http.protocol import APIError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput


class HookedAsyncLLMEngine(AsyncLLMEngine):
    """AsyncLLMEngine whose step loop can be made to hang or to fail on demand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stall_until = 0.0
        self._fail_steps = 0  # how many coming steps raise
        self.step_delay = 0.0  # seconds added to every step

    def stall_for(self, seconds: float) -> None:
        """Make the step loop hang for `seconds` (as a stuck step would)."""
        self._stall_until = time.monotonic() + seconds
        self.abort("")  # wake an idle loop so it starts stalling now

    def fail_steps(self, count: int) -> None:
        """Make the next `count` steps raise (as a device error would)."""
        self._fail_steps = count

    def _apply_commands(self, engine: LLMEngine, block: bool) -> None:
        super()._apply_commands(engine, block)
        remaining = self._stall_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)  # no heartbeat meanwhile: /health reports the stall

    def _step(self, engine: LLMEngine) -> None:
        if self.step_delay:
            time.sleep(self.step_delay)
        if self._fail_steps <= 0:
            super()._step(engine)
            return
        self._fail_steps -= 1

        def failing_step() -> list[RequestOutput]:
            raise RuntimeError("test hook: failing this step")

        engine.step = failing_step  # type: ignore[method-assign]
        try:
            super()._step(engine)
        finally:
            del engine.step  # the class's own step again


def add_test_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """POST /debug/stall and /debug/fail-steps on a server of a HookedAsyncLLMEngine."""
    assert isinstance(engine, HookedAsyncLLMEngine)

    @app.post("/debug/stall")
    async def stall(request: Request) -> Response:
        """Hang the step loop for `seconds`."""
        seconds = (await _json_body(request)).get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds <= 600:
            raise APIError(400, "'seconds' must be a number in [0, 600]", param="seconds")
        engine.stall_for(float(seconds))
        return Response(dumps({"stalled_for": seconds}), media_type="application/json")

    @app.post("/debug/step-delay")
    async def step_delay(request: Request) -> Response:
        """Make every step take `seconds` longer."""
        seconds = (await _json_body(request)).get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds <= 10:
            raise APIError(400, "'seconds' must be a number in [0, 10]", param="seconds")
        engine.step_delay = float(seconds)
        return Response(dumps({"step_delay": seconds}), media_type="application/json")

    @app.get("/debug/in-flight")
    async def in_flight() -> Response:
        """Requests admitted and not finished."""
        return Response(dumps({"in_flight": engine.num_in_flight}), media_type="application/json")

    @app.post("/debug/fail-steps")
    async def fail_steps(request: Request) -> Response:
        """Make the next `steps` engine steps raise."""
        steps = (await _json_body(request)).get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= 1000:
            raise APIError(400, "'steps' must be an integer in [0, 1000]", param="steps")
        engine.fail_steps(steps)
        return Response(dumps({"failing_steps": steps}), media_type="application/json")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from exc
    return body if isinstance(body, dict) else {}


def main(argv: list[str] | None = None) -> int:
    """`python -m engine`'s command line, serving the hooked engine."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return serve(args, engine_class=HookedAsyncLLMEngine, extend_app=add_test_routes)


if __name__ == "__main__":
    sys.exit(main())
