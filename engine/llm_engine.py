"""LLMEngine: add_request / step / abort over the scheduler, model runner and sampler.

Text work lives beside it: InputProcessor tokenizes and checks prompts and builds sequences,
OutputProcessor turns sampled tokens into deltas; the engine keeps the stop check.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.default_model import resolve_model
from engine.errors import EngineError, InvalidRequestError
from engine.input_processor import InputProcessor, PreparedPrompt, Prompt
from engine.kv_sizing import KVCompanion
from engine.model_runner import ModelRunner, resolve_device
from engine.models.config import ModelConfig
from engine.output_processor import OutputProcessor
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel.sharding import check_divisible
from engine.parallel.workers import start_workers, stop_workers, threads_per_rank
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode import SpecDecodeStats, SpeculativeConfig, Speculator
from engine.spec_decode.draft_model import DraftProposer
from engine.spec_decode.verify import SampledLogprob, verify
from engine.tokenizer import has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of the engine at one moment; the counters only grow."""

    num_running: int  # requests with a sequence in the running batch
    num_waiting: int  # requests waiting for admission (preempted ones included)
    kv_cache_usage: float  # fraction of KV blocks held by sequences
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]


class LLMEngine:
    """The engine's synchronous core: one `step()` schedules, runs the model and postprocesses."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        model_dir = resolve_model(config.model)
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer: Any = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self._workers: list[Any] = []
        tp = None
        if config.tensor_parallel_size > 1:  # this process is rank 0; the other ranks start here
            check_divisible(self.model_config, config.tensor_parallel_size)
            torch.set_num_threads(threads_per_rank(config))
            device = resolve_device(config)
            tp, self._workers = start_workers(config, model_dir, self.max_model_len, device)
        try:
            companion = self._draft_footprint(config)
            self.runner = ModelRunner(config, self.model_config, model_dir, self.max_model_len, tp, companion)
        except BaseException:
            stop_workers(self._workers)
            raise
        self._closer = weakref.finalize(self, _stop, self.runner, self._workers) if tp is not None else None
        layout = self.runner.layout
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, config.enable_prefix_caching)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)
        self.speculator = None if spec is None else Speculator(spec, self.max_model_len, self._draft(spec))
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.speculator
        )
        self.sampler = Sampler(config.seed, self.runner.device)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.model_config,
            self.max_model_len,
            layout.num_token_slots,
            self.eos_token_ids,
            self.runner.device,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, _Request] = {}
        self._ready: list[RequestOutput] = []  # resumed requests whose replay already finished them
        # the requests the last step failed on their own (dropped, blocks freed), with their errors,
        # and their final (aborted) outputs, for whoever counts finished requests
        self.failed: dict[str, EngineError] = {}
        self.dropped: list[RequestOutput] = []
        self.step_request_ids: list[str] = []  # requests the current (or last) step runs

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Validate and queue a request; raises an InvalidRequestError subclass when it cannot run.

        `add_special_tokens=False` is for text that already holds them (a rendered chat template).
        `resume_token_ids`: go on with a completion whose output so far is these tokens.
        """
        params = params or SamplingParams()
        prepared = self.inputs.prepare(prompt, params, add_special_tokens, resume_token_ids)
        self.add_prepared(request_id, prepared, params, arrival_time)

    def add_prepared(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request `inputs.prepare()` accepted (step-loop thread only)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = self.inputs.sequences(request_id, prepared, params, arrival)
        stop = self._replay(seqs[0], prepared.resume_token_ids) if prepared.resume_token_ids else None
        req = _Request(request_id, prepared.prompt, prepared.prompt_token_ids, seqs)
        self._requests[request_id] = req
        if stop is not None:  # the tokens it was resumed with end it: its last delta, at the next step
            self._ready.append(self._request_output(req, [self.output_processor.completion(seqs[0], [], [])]))
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _replay(self, seq: Sequence, tokens: tuple[int, ...]) -> tuple[str, int | str | None] | None:
        """A resumed sequence takes its earlier output as if it had sampled it: text, stop strings,
        grammar state, penalties, seeds and max_tokens all go on from there; its KV is computed by
        its first step, as after a recompute preemption. Returns the stop its last token reached.

        The tokens come from another replica of this model, which streamed them: a token the grammar
        forbids, or tokens past a stop, were not sampled by it, and are refused.
        """
        for i, token in enumerate(tokens):
            seq.append_token(token)
            if seq.guided is not None and not seq.guided.accept_token(token):
                raise InvalidRequestError(
                    f"resume token {i} ({token}) is not allowed by the request's output format",
                    param="resume.token_ids",
                )
            stop = self._check_stop(seq, token)
            if stop is not None:
                if i != len(tokens) - 1:
                    raise InvalidRequestError(
                        f"the completion stops at resume token {i} of {len(tokens)}", param="resume.token_ids"
                    )
                seq.finish(*stop)  # before take_text: everything is decided
                seq.replayed_text = seq.take_text()
                return stop
        seq.replayed_text = seq.take_text()
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final delta (None if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        running = [seq for seq in req.seqs if not seq.is_finished]
        for seq in running:
            self.scheduler.finish(seq, "abort")
        ends = [self.output_processor.completion(seq, [], []) for seq in running]
        return self._request_output(req, ends)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests still waiting or running."""
        return list(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests not finished yet."""
        return len(self._requests)

    def stats(self) -> EngineStats:
        """A snapshot of queue, KV-cache and prefix-cache figures (for metrics and health)."""
        sched, bm = self.scheduler, self.block_manager
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions,
            spec_decode=self.speculator.stats() if self.speculator is not None else None,
        )

    @staticmethod
    def _draft_footprint(config: EngineConfig) -> KVCompanion | None:
        """A draft model's share of a GPU whose free memory sizes the KV pool (loaded after it)."""
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # parsed by EngineConfig
        if spec is None or spec.method != "draft_model" or config.kv_cache_memory is not None:
            return None
        if resolve_device(config).type != "cuda":
            return None
        assert spec.model is not None
        return DraftProposer.footprint(spec.model, config)

    def _draft(self, spec: SpeculativeConfig) -> DraftProposer | None:
        """The draft model (method draft_model), its KV pool as many tokens as the target's."""
        if spec.method != "draft_model":
            return None
        assert spec.model is not None
        slots = self.runner.layout.num_token_slots
        return DraftProposer.load(
            spec.model, self.config, self.model_config, self.tokenizer, self.max_model_len, slots
        )

    def close(self) -> None:
        """Let the worker ranks go (also done when the engine is collected, or at exit)."""
        if self._closer is not None:
            self._closer()

    @property
    def tensor_parallel(self) -> bool:
        """Whether worker processes hold shares of the model (a failed step then leaves the ranks
        out of step: it is fatal)."""
        return self.runner.tp is not None

    def check_workers(self) -> None:
        """RuntimeError when a worker rank's process (on this node) has exited (the engine cannot go
        on); a rank on another node that fails shows as a failed collective instead."""
        for rank, process in enumerate(self._workers, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited (code {process.exitcode})")

    def speculative_settings(self) -> dict[str, Any] | None:
        """Speculative decoding's settings as served (None: off), for /v1/models and the log."""
        if self.speculator is None:
            return None
        return dataclasses.asdict(self.speculator.config)

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a delta for each request that made progress."""
        self.step_request_ids = []
        self.failed, self.dropped = {}, []
        ready = [out for out in self._ready if self._requests.pop(out.request_id, None) is not None]
        self._ready = []  # (an aborted one was popped by the abort)
        sched = self.scheduler.schedule()
        # the requests this step runs: if the step raises, they are the ones to fail
        self.step_request_ids = list(dict.fromkeys(s.seq.request_id for s in sched.scheduled))
        if sched.is_empty:
            return ready
        logits = self.runner.execute(sched.scheduled)
        return ready + self._postprocess(sched, logits)

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        emitted = self._choose_tokens(sched, logits)
        now = time.monotonic()
        stops: list[tuple[Sequence, tuple[str, int | str | None]]] = []
        for s, tokens, logprobs in emitted:
            seq = s.seq
            taken = 0
            for token in tokens:
                seq.append_token(token)
                taken += 1
                if seq.guided is not None and not seq.guided.accept_token(token):
                    # a token its mask allowed, refused on the parser's limits: this request fails,
                    # the others of the step go on
                    self.failed.setdefault(seq.request_id, seq.guided.failure())
                    break
                stop = self._check_stop(seq, token)
                if stop is not None:
                    stops.append((seq, stop))
                    break
            if seq.first_token_time is None:
                seq.first_token_time = now
            if s.spec_tokens:  # KV holds the last token and the accepted drafts: one per token taken
                assert self.speculator is not None
                self.speculator.record(seq, len(s.spec_tokens), len(tokens) - 1)
                s.num_new_tokens = taken
            del tokens[taken:], logprobs[taken:]  # what a stop cut off is not output
        self.scheduler.update_after_step(sched.scheduled)
        for seq, stop in stops:
            self.scheduler.finish(seq, *stop)
        for request_id in self.failed:  # frees its blocks; its error is the caller's to take
            dropped = self.abort_request(request_id)
            if dropped is not None:
                self.dropped.append(dropped)
        deltas: dict[str, list[CompletionOutput]] = {}
        for s, tokens, logprobs in emitted:
            if s.seq.request_id in self.failed:
                continue
            delta = self.output_processor.completion(s.seq, tokens, logprobs)
            deltas.setdefault(s.seq.request_id, []).append(delta)
        outputs = []
        for request_id, comps in deltas.items():
            req = self._requests[request_id]
            comps.sort(key=lambda c: c.index)
            out = self._request_output(req, comps)
            if out.finished:
                del self._requests[request_id]
            outputs.append(out)
        return outputs

    def _choose_tokens(
        self, sched: SchedulerOutput, logits: torch.Tensor
    ) -> list[tuple[ScheduledSeq, list[int], list[SampledLogprob | None]]]:
        """Each sampling sequence's new tokens and their logprobs, in scheduled order: one sampled
        token, or (speculating) the accepted drafts and the model's own token after them."""
        plain_rows: list[int] = []
        plain: list[ScheduledSeq] = []
        chosen: dict[int, tuple[list[int], list[SampledLogprob | None]]] = {}
        row = 0
        for i, s in enumerate(sched.scheduled):
            if s.spec_tokens:
                rows = logits[row : row + s.num_sampled_rows]
                chosen[i] = verify(rows, s.seq, s.spec_tokens, self.sampler.generator)
            elif s.samples:
                plain_rows.append(row)
                plain.append(s)
            row += s.num_sampled_rows
        if plain:
            rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            result = self.sampler(rows, [s.seq for s in plain])
            sampled = iter(zip(result.token_ids, result.logprobs, strict=True))
        emitted = []
        for i, s in enumerate(sched.scheduled):
            if i in chosen:
                emitted.append((s, *chosen[i]))
            elif s.samples:
                token, logprob = next(sampled)
                emitted.append((s, [token], [logprob]))
        return emitted

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """Stop token / EOS, stop string, a complete grammar, max_tokens, context length: the first
        that holds.

        A grammar that allows nothing but EOS next ends the sequence at once ("stop"), even under
        ignore_eos or an unmet min_tokens: its output is whole, and masking EOS too would leave no
        token to sample.
        """
        params = seq.params
        check = seq.num_output_tokens >= params.min_tokens
        # the text flushed at the end (what waited on a character's next bytes) may complete a stop
        # string: it is cut off then, and the sequence stopped on it, whatever else ended it
        if token in seq.stop_token_ids:  # the sampler masks them until min_tokens
            if seq.detokenizer is not None and params.include_stop_str_in_output:  # its text too (vLLM)
                seq.detokenizer.add_token(token, check_stop=False)
            flushed = seq.detokenizer.flush(check) if seq.detokenizer is not None else None
            explicit = token in (params.stop_token_ids or ())
            return "stop", flushed if flushed is not None else token if explicit else None
        if seq.detokenizer is not None:
            stop_string = seq.detokenizer.add_token(token, check)
            if stop_string is not None:
                return "stop", stop_string
        if seq.guided is not None and seq.guided.is_terminated():
            return "stop", seq.detokenizer.flush(check) if seq.detokenizer is not None else None
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            flushed = seq.detokenizer.flush(check) if seq.detokenizer is not None else None
            return ("length", None) if flushed is None else ("stop", flushed)
        return None

    def _request_output(self, req: _Request, completions: list[CompletionOutput]) -> RequestOutput:
        return self.output_processor.request(
            req.request_id, req.prompt, req.prompt_token_ids, req.seqs, completions
        )


def _stop(runner: ModelRunner, workers: list[Any]) -> None:
    """Tell the worker ranks to exit, then wait for them (at close or garbage collection)."""
    try:
        runner.release_workers()
    except RuntimeError:  # a worker already gone (killed, timed out): nothing to tell it
        logger.warning("a tensor-parallel worker was gone at shutdown")
    finally:
        stop_workers(workers)
        if runner.tp is not None:
            runner.tp.close()


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None:
        limit = min(limit, model_config.sliding_window)  # attention without the window is exact up to here
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len
