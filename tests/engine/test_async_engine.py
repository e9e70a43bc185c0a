"""AsyncLLMEngine in-process: life cycle, health states, draining and a dying step loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.engine_state import EngineDeadError, EngineUnavailableError, RequestFailedError
from engine.errors import ContextLengthExceededError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.engine.hooked_server import HookedAsyncLLMEngine


def _engine(model: Path, **kwargs: float) -> HookedAsyncLLMEngine:
    return HookedAsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20), "tiny", **kwargs)


@pytest.fixture
def tiny(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def test_health_is_loading_until_the_model_is_ready(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        try:
            assert engine.health().state == "loading" and not engine.health().healthy
            with pytest.raises(EngineUnavailableError) as info:
                await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
            assert info.value.code == "engine_loading"
            await engine.wait_ready(60)
            assert engine.health().healthy
        finally:
            engine.shutdown()
        assert engine.health().state == "stopped"

    asyncio.run(run())


def test_a_model_that_fails_to_load_leaves_the_engine_dead(tmp_path: Path) -> None:
    async def run() -> None:
        engine = _engine(tmp_path / "missing")
        engine.start()
        with pytest.raises(EngineDeadError):
            await engine.wait_ready(60)
        health = engine.health()
        assert health.state == "dead" and not health.healthy and "loading failed" in health.detail
        engine.shutdown()

    asyncio.run(run())


def test_admission_errors_reach_the_caller_and_leave_nothing_behind(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        await engine.wait_ready(60)
        try:
            with pytest.raises(ContextLengthExceededError):
                await engine.add_request("long", [5] * 2000, SamplingParams(max_tokens=2))
            assert engine.num_in_flight == 0
            outs = [o async for o in engine.generate("ok", [5, 6, 7], SamplingParams(max_tokens=3))]
            assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_engine_goes_on(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        await engine.wait_ready(60)
        assert engine.engine is not None
        try:
            engine.fail_steps(1)
            with pytest.raises(RequestFailedError) as info:
                async for _ in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=5)):
                    pass
            assert "test hook" not in str(info.value)  # no internal text travels to the client
            assert engine.health().healthy
            assert engine.engine.stats().kv_cache_usage == 0.0 and engine.num_in_flight == 0
            outs = [o async for o in engine.generate("s", [1, 2, 3], SamplingParams(max_tokens=3))]
            assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_only_the_requests_of_the_failed_step_fail(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        await engine.wait_ready(60)
        assert engine.engine is not None
        real_step = engine.engine.step
        calls = 0

        def step_failing_once_with_a_newcomer() -> list[RequestOutput]:
            nonlocal calls
            calls += 1
            if (
                engine.engine is not None
                and "late" in engine.engine.unfinished_request_ids()
                and calls < 1000
            ):
                calls = 1000
                engine.engine.step_request_ids = ["late"]  # as if the step had scheduled only "late"
                raise RuntimeError("device error")
            return real_step()

        engine.engine.step = step_failing_once_with_a_newcomer  # type: ignore[method-assign]
        try:
            early = await engine.add_request(
                "early", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)
            )
            late = await engine.add_request("late", [4, 5, 6], SamplingParams(max_tokens=3))
            with pytest.raises(RequestFailedError):
                async for _ in late:
                    pass
            late.close()
            outs = [o async for o in early]
            early.close()
            assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_repeated_step_failures_kill_the_engine_and_refuse_new_requests(tiny: Path) -> None:
    async def run() -> None:
        engine = AsyncLLMEngine(
            EngineConfig(model=str(tiny), kv_cache_memory=16 << 20, max_consecutive_step_failures=2), "tiny"
        )
        engine.start()
        await engine.wait_ready(60)
        assert engine.engine is not None

        def broken_step() -> list[object]:
            raise RuntimeError("device lost at 0xdeadbeef")

        engine.engine.step = broken_step  # type: ignore[method-assign,assignment]
        try:
            with pytest.raises(RequestFailedError):
                async for _ in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=5)):
                    pass
            assert not engine.is_dead
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("s", [1, 2, 3], SamplingParams(max_tokens=5)):
                    pass
            health = engine.health()
            assert health.state == "dead" and not health.healthy and engine.is_dead
            assert "0xdeadbeef" not in health.detail
            with pytest.raises(EngineUnavailableError) as info:
                await engine.add_request("t", [1, 2], SamplingParams())
            assert info.value.code == "engine_dead"
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_drain_lets_requests_finish_and_refuses_new_ones(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        await engine.wait_ready(60)
        try:
            stream = await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
            drain = asyncio.create_task(engine.drain(30))
            await asyncio.sleep(0)
            assert engine.health().state == "draining"
            with pytest.raises(EngineUnavailableError) as info:
                await engine.add_request("late", [1], SamplingParams())
            assert info.value.code == "engine_draining"
            outs = [o async for o in stream]
            stream.close()
            assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 40
            assert await drain == 0
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_drain_timeout_aborts_what_is_left(tiny: Path) -> None:
    async def run() -> None:
        engine = _engine(tiny)
        engine.start()
        await engine.wait_ready(60)
        try:
            engine.stall_for(1.0)  # keep the request from finishing before the timeout
            stream = await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
            assert await engine.drain(0.2) == 1
            outs = [o async for o in stream]
            assert outs[-1].finish_reason == "abort"
            assert engine.engine is not None and engine.engine.stats().kv_cache_usage == 0.0
        finally:
            engine.shutdown()

    asyncio.run(run())
