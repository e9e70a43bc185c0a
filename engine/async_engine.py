"""AsyncLLMEngine: one engine thread running the step loop, fed by asyncio request handlers.

The thread owns the LLMEngine: every add and abort travels to it through a command queue and
is applied between steps, so a request that arrives while others run joins the next step.
Each step's deltas travel back through `loop.call_soon_threadsafe` into one RequestStream per
request, which folds the deltas its reader has not taken yet (a slow reader gets several tokens
at once).

Prompts are tokenized and length-checked in a small worker pool before they reach the thread:
a 16 MiB prompt used to hold every running request for 25 s. An unexpected error in a step
fails the requests of that step and the loop goes on; after `max_consecutive_step_failures`
failed steps in a row the engine is dead, and the server exits non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine_state import (
    EngineDeadError,
    EngineState,
    EngineUnavailableError,
    Health,
    RequestFailedError,
)
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor, PreparedPrompt, Prompt
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.model_info import ModelInfo, model_info
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT = 0.25  # seconds the idle loop sleeps between heartbeats
_ABORT_GRACE = 5.0  # seconds aborted requests get to deliver their final output when draining
# Tokenizer workers: the Rust tokenizer releases the GIL, so a long prompt in one worker leaves
# the others (and the event loop, and the step loop) running.
_TOKENIZER_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class _Add:
    request_id: str
    prepared: PreparedPrompt
    params: SamplingParams
    arrival_time: float
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Serves many concurrent async callers from one background step loop."""

    def __init__(self, config: EngineConfig, model_name: str, stall_timeout: float = 30.0) -> None:
        self.config = config
        self.model_name = model_name
        self.stall_timeout = stall_timeout
        self.metrics = EngineMetrics(model_name)
        self.engine: LLMEngine | None = None  # the engine thread's own; others read `model_info`
        self.model_info: ModelInfo | None = None  # published once the model is loaded
        self._inputs: InputProcessor | None = None  # thread-safe part of the engine: prompt checks
        self._state = EngineState.LOADING
        self._error: str | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self._failures = 0  # failed steps in a row
        self._stopping = False
        self._tokenizers: concurrent.futures.ThreadPoolExecutor | None = None
        self._idle = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread: it loads the model, then runs the step loop."""
        assert self._thread is None, "start() once"
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            _TOKENIZER_WORKERS, thread_name_prefix="engine-tokenize"
        )
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the model is loaded (raises EngineDeadError if loading failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._state is EngineState.LOADING:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish loading in time")
            await asyncio.sleep(0.05)
        if self._state is EngineState.DEAD:
            raise EngineDeadError(self._error or "the engine failed")

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let requests in flight finish for up to `timeout` s, abort the rest.

        Returns how many requests were aborted.
        """
        if self._state is EngineState.READY:
            self._state = EngineState.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except TimeoutError:
            pending = list(self._streams)
        logger.warning("drain timeout: aborting %d request(s)", len(pending))
        for request_id in pending:
            self._commands.put(_Abort(request_id))
        with contextlib.suppress(TimeoutError):  # their handlers still send the last bytes
            await asyncio.wait_for(self._idle.wait(), _ABORT_GRACE)
        return len(pending)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still in flight are aborted)."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._tokenizers is not None:
            self._tokenizers.shutdown(wait=False, cancel_futures=True)
        if self._inputs is not None:
            self._inputs.close()
        if self._state is not EngineState.DEAD:
            self._state = EngineState.STOPPED

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool = True,
        resume_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Queue a request once it is admitted; the caller must `close()` the returned stream.

        `resume_token_ids`: go on with a completion whose output so far is these tokens.

        Raises EngineUnavailableError when not accepting, InvalidRequestError (and subclasses)
        when the engine rejects the request.
        """
        self.check_accepting()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self._release)
        self._streams[request_id] = stream
        self._idle.clear()
        arrival = time.monotonic()
        try:
            prepared = await self._prepare(prompt, params, add_special_tokens, resume_token_ids)
            stream.prompt_tokens = len(prepared.prompt_token_ids)
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._commands.put(_Add(request_id, prepared, params, arrival, done))
            # A cancelled wait (the client left) cancels `done`; the engine thread then skips the add.
            await asyncio.wrap_future(done)
        except BaseException:
            stream.close()
            raise
        return stream

    async def _prepare(
        self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool, resume: list[int] | None
    ) -> PreparedPrompt:
        """Tokenize and check lengths in a worker thread, and compile the request's constraint on
        the compiler's thread meanwhile: off the event loop and off the step loop."""
        inputs = self._inputs
        assert inputs is not None and self._tokenizers is not None and self._loop is not None
        tokenized = self._loop.run_in_executor(
            self._tokenizers, inputs.prepare_prompt, prompt, params, add_special_tokens, resume
        )
        if params.guided is None:
            return await tokenized
        try:
            grammar = await inputs.compiler(params.guided).compile_async(params.guided)
        finally:
            prepared = await tokenized  # its error first: a prompt too long is the bigger mistake
        return dataclasses.replace(prepared, grammar=grammar)

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its deltas (coalesced when read slowly); leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params, add_special_tokens)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step)."""
        self._commands.put(_Abort(request_id))

    def _release(self, request_id: str, abort: bool) -> None:
        if abort:
            self._commands.put(_Abort(request_id))
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def check_accepting(self) -> None:
        """Raise EngineUnavailableError (a 503 with its reason: loading, draining, dead, stopped)
        unless the engine takes requests now."""
        state = self._state
        if state is EngineState.READY:
            return
        if state is EngineState.LOADING:
            raise EngineUnavailableError("the model is still loading; retry shortly", "engine_loading")
        if state is EngineState.DRAINING:
            raise EngineUnavailableError("the server is shutting down", "engine_draining")
        if state is EngineState.DEAD:
            raise EngineUnavailableError("the engine failed and is restarting; retry shortly", "engine_dead")
        raise EngineUnavailableError("the engine is stopped", "engine_stopped")

    # -------------------------------------------------------------------- health
    @property
    def num_in_flight(self) -> int:
        """Requests admitted or queued that have not finished."""
        return len(self._streams)

    def health(self) -> Health:
        """Loaded, loop alive and making progress: only then healthy."""
        since = time.monotonic() - self._heartbeat
        state = self._state
        if state is EngineState.READY:
            alive = self._thread is not None and self._thread.is_alive()
            if not alive:
                return Health("dead", False, "the engine loop is not running", since)
            if since > self.stall_timeout:
                return Health("stalled", False, f"no progress for {since:.1f}s", since)
            return Health("ready", True, "ok", since)
        detail = {
            EngineState.LOADING: "loading the model",
            EngineState.DRAINING: "shutting down: finishing requests in flight",
            EngineState.STOPPED: "stopped",
            EngineState.DEAD: f"the engine failed ({self._error}); see the server log",
        }[state]
        return Health(state.value, False, detail, since)

    @property
    def is_dead(self) -> bool:
        """The engine cannot serve any more: loading or the step loop failed, or its thread is gone."""
        return self.health().state == "dead"

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            engine = LLMEngine(self.config)
            info = model_info(
                self.model_name, self.config.model, engine.max_model_len, engine.tokenizer, engine.model_dir,
                engine.runner.precision(), engine.speculative_settings(),
            )  # fmt: skip
        except Exception:
            logger.exception("loading the model failed")
            self._error = "loading failed"
            self._state = EngineState.DEAD
            return
        self.engine, self.model_info, self._inputs = engine, info, engine.inputs
        self._heartbeat = time.monotonic()
        self._state = EngineState.READY
        logger.info("engine ready: %s (%s; speculative decoding %s)", self.model_name,
                    ", ".join(f"{k} {v}" for k, v in info.precision.items()),
                    "off" if info.speculative is None else dict(info.speculative))  # fmt: skip
        try:
            self._loop_forever(engine)
        except Exception:
            logger.exception("the engine step loop failed; the engine is dead")
            self._error = "the step loop failed"
            self._state = EngineState.DEAD
            self._fail_all(EngineDeadError(self._error))
            self._reject_until_stopped(EngineDeadError(self._error))

    def _reject_until_stopped(self, error: EngineDeadError) -> None:
        """A dead loop still answers the command queue, so that no caller waits forever."""
        while not self._stopping:
            cmd = self._commands.get()
            if isinstance(cmd, _Add) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(error)
            elif cmd is None:
                self._stopping = True

    def _loop_forever(self, engine: LLMEngine) -> None:
        while not self._stopping:
            self._heartbeat = time.monotonic()
            engine.check_workers()  # a dead rank ends the engine even while it is idle
            self._apply_commands(engine, block=not engine.has_unfinished_requests())
            if engine.has_unfinished_requests():
                self._step(engine)
        for request_id in engine.unfinished_request_ids():
            self._abort(engine, request_id)

    def _step(self, engine: LLMEngine) -> None:
        """One step; if it raises, its requests fail and the loop goes on, until too many in a row."""
        engine.step_request_ids = []  # step() fills it once scheduled; still empty: fail them all
        try:
            outputs = engine.step()
        except Exception:
            self._failures += 1
            # tensor parallel: after a failed collective the ranks are out of step, never retried
            if self._failures >= self.config.max_consecutive_step_failures or engine.tensor_parallel:
                raise  # _run marks the engine dead
            logger.exception("a step failed (%d in a row); failing its requests", self._failures)
            self._fail_step_requests(engine)
            return
        self._failures = 0
        now = time.monotonic()
        self.metrics.record_outputs(outputs, now)
        self.metrics.record_stats(engine.stats())
        if outputs:
            self._deliver(outputs)
        for out in engine.dropped:  # failed on their own (dropped by the step): finished for the metrics
            self.metrics.record_aborted(out, now)
        for request_id, error in engine.failed.items():
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail_in_loop, [request_id], error)

    def _fail_step_requests(self, engine: LLMEngine) -> None:
        """Drop the requests the failed step ran (all unfinished ones when scheduling itself failed)."""
        request_ids = engine.step_request_ids or engine.unfinished_request_ids()
        for request_id in request_ids:
            out = engine.abort_request(request_id)  # frees its blocks
            if out is not None:
                self.metrics.record_aborted(out, time.monotonic())
        self.metrics.record_stats(engine.stats())
        error = RequestFailedError("a step of this request failed")
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_in_loop, request_ids, error)

    def _fail_in_loop(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)
        if not self._streams:
            self._idle.set()

    def _apply_commands(self, engine: LLMEngine, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._add(engine, cmd)
            elif isinstance(cmd, _Abort):
                self._abort(engine, cmd.request_id)  # an unknown id (e.g. finished already): nothing
            else:
                self._stopping = True
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        # False when the caller already gave up (its wait was cancelled): setting a result on a
        # cancelled future raises InvalidStateError, which used to kill this loop.
        if not cmd.done.set_running_or_notify_cancel():
            return
        try:
            engine.add_prepared(cmd.request_id, cmd.prepared, cmd.params, cmd.arrival_time)
        except Exception as exc:  # a ValueError is the request's fault; anything else fails just this add
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", cmd.request_id)
                exc = RequestFailedError("the engine could not admit this request")
            cmd.done.set_exception(exc)
            return
        cmd.done.set_result(None)

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        out = engine.abort_request(request_id)
        if out is None:
            return
        self.metrics.record_aborted(out, time.monotonic())
        self.metrics.record_stats(engine.stats())
        self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver_in_loop, outputs)

    def _deliver_in_loop(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:  # no longer in flight, even if its reader never comes back for it
                del self._streams[out.request_id]
        if not self._streams:
            self._idle.set()

    def _fail_all(self, error: BaseException) -> None:
        assert self._loop is not None

        def fail() -> None:
            for stream in self._streams.values():
                stream.fail(error)
            self._streams.clear()
            self._idle.set()

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fail)
