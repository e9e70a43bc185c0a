"""OutputProcessor: a step's sampled tokens become per-request deltas (new tokens, text, logprobs).

The engine calls it once per sequence that sampled (with its tokens of the step: several when
speculative drafts were accepted), after the stop check, and once per request that made progress.
Everything it builds is new this step: the tokens, the text the detokenizer has decided
since the last step (a possible start of a stop string stays back), the token's logprob entry with
its decoded text. No step copies a request's output so far.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sequence import Logprob, Sequence
from engine.token_bytes import TokenBytes

# (sampled token's logprob, its rank, [(token id, logprob)] of the top-k)
SampledLogprob = tuple[float, int, list[tuple[int, float]]]


class OutputProcessor:
    """Builds the deltas a step returns; holds the tokenizer that decodes logprob tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None for folders without one: no text, logprob tokens undecoded
        self._bytes = TokenBytes(tokenizer) if tokenizer is not None else None

    def completion(
        self, seq: Sequence, tokens: list[int], logprobs: list[SampledLogprob | None]
    ) -> CompletionOutput:
        """The delta of one completion: this step's `tokens` (none on abort; several when drafts
        were accepted), each with its logprob when the request asked for them."""
        entries: list[dict[int, Logprob]] | None = None
        if seq.params.logprobs is not None:
            entries = []
            for token, logprob in zip(tokens, logprobs, strict=True):
                assert logprob is not None
                entries.append(self._logprob_entry(token, logprob))
                before = seq.cumulative_logprob
                seq.cumulative_logprob = logprob[0] if before is None else before + logprob[0]
        replayed, seq.replayed_text = seq.replayed_text, ""
        return CompletionOutput(
            index=seq.index,
            text=seq.take_text(),
            token_ids=list(tokens),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=entries,
            cumulative_logprob=seq.cumulative_logprob,
            replayed_text=replayed,
        )

    def request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: list[Sequence],
        completions: Iterable[CompletionOutput],
    ) -> RequestOutput:
        """A request's delta; once every sequence has finished it lists all of them (index order)."""
        finished = all(s.is_finished for s in seqs)
        comps = list(completions)
        if finished:  # completions that ended in earlier steps report their finish reason again
            have = {c.index for c in comps}
            comps += [_ended(s) for s in seqs if s.index not in have]
            comps.sort(key=lambda c: c.index)
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=comps,
            finished=finished,
            metrics=_metrics(seqs, finished),
            num_generated_tokens=sum(s.num_output_tokens for s in seqs),
        )

    def _logprob_entry(self, token: int, logprob: SampledLogprob) -> dict[int, Logprob]:
        value, rank, top = logprob
        entry = {token: self._logprob(token, value, rank)}
        for i, (tid, lp) in enumerate(top):
            if tid not in entry:
                entry[tid] = self._logprob(tid, lp, i + 1)
        return entry

    def _logprob(self, token_id: int, value: float, rank: int) -> Logprob:
        if self._bytes is None:  # no tokenizer: ids only
            return Logprob(value, rank)
        text = str(self.tokenizer.decode([token_id]))
        return Logprob(value, rank, text, self._bytes.partial(token_id, text))


def _ended(seq: Sequence) -> CompletionOutput:
    """An empty delta of a completion that finished earlier: its reason and totals only."""
    entries: list[dict[int, Logprob]] | None = [] if seq.params.logprobs is not None else None
    return CompletionOutput(
        seq.index, "", [], seq.finish_reason, seq.stop_reason, entries, seq.cumulative_logprob
    )


def _metrics(seqs: list[Sequence], finished: bool) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=seqs[0].arrival_time,
        first_scheduled_time=_min_time(s.first_scheduled_time for s in seqs),
        first_token_time=_min_time(s.first_token_time for s in seqs),
        finished_time=max((s.finished_time or 0.0) for s in seqs) if finished else None,
        num_cached_tokens=seqs[0].num_cached_tokens,
        num_preemptions=sum(s.num_preemptions for s in seqs),
    )


def _min_time(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None
