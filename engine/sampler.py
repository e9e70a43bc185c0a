"""Sampler: logits -> token ids (+ logprobs), with per-request parameters and generators."""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from engine.guided import BitmaskFiller, allocate_bitmask, apply_token_bitmask
from engine.sequence import Sequence


@dataclass
class SamplerOutput:
    """Sampled tokens and, for sequences that asked, their logprobs."""

    token_ids: list[int]
    # per row: (sampled token logprob, its rank, [(token id, logprob)] top-N) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    """Masks guided rows to their grammar, applies penalties, temperature, top-k / top-p / min-p,
    then samples row by row.

    The grammar mask comes first, so every later setting only ever sees allowed tokens, and
    logprobs describe the masked distribution (as vLLM's do). Randomness comes from the
    exponential-race trick (argmax of p / Exp(1) noise), with noise drawn from the sequence's
    own generator when it has a seed, so a seeded request gives the same tokens whatever else is
    in the batch (the mask is per row: a guided row's bits do not depend on the others either).
    """

    def __init__(self, seed: int, device: torch.device | None = None) -> None:
        # on the logits' device: a CUDA tensor draws only from a CUDA generator
        self.generator = torch.Generator(device=device or torch.device("cpu")).manual_seed(seed)
        self._filler: BitmaskFiller | None = None  # llguidance's fill threads, made on first use

    @torch.inference_mode()  # the runner's logits are inference tensors: masked in place here
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: (num_seqs, vocab) float32, one row per sequence to sample."""
        assert logits.shape[0] == len(seqs)
        logits = logits.float()
        self._apply_grammars(logits, seqs)
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if any(s.params.has_penalties for s in seqs):
            logits = apply_penalties(logits.clone(), seqs)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = mask_stop_tokens_before_min(logits.clone(), seqs)
        greedy = [s.params.is_greedy for s in seqs]
        tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, seqs, greedy)
        token_list = [int(t) for t in tokens.tolist()]
        out_logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] = []
        for row, seq in enumerate(seqs):
            if raw_logprobs is None or seq.params.logprobs is None:
                out_logprobs.append(None)
                continue
            out_logprobs.append(sampled_logprob(raw_logprobs[row], token_list[row], seq.params.logprobs))
        return SamplerOutput(token_list, out_logprobs)

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf, in place, for every token a guided row's grammar does not allow next."""
        rows = [i for i, s in enumerate(seqs) if s.guided is not None]
        if not rows:
            return
        matchers = [m for m in (seqs[i].guided for i in rows) if m is not None]
        if self._filler is None:
            self._filler = BitmaskFiller()
        bitmask = allocate_bitmask(len(rows), matchers[0].compiled.vocab_size)
        self._filler.fill(matchers, bitmask)  # drops the GIL: the event loop goes on meanwhile
        apply_token_bitmask(logits, bitmask, None if len(rows) == len(seqs) else rows)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor(
            [1.0 if g else s.params.temperature for s, g in zip(seqs, greedy, strict=True)], device=device
        )
        scaled = logits / temps[:, None]
        scaled = apply_top_k_top_p_min_p(scaled, seqs)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        shared_rows = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared_rows:
            draw = torch.empty((len(shared_rows), probs.shape[1]), device=device)
            draw.exponential_(generator=self.generator)
            noise[shared_rows] = draw
        for i, s in enumerate(seqs):
            generator = s.seeded_generator()
            if generator is not None:
                noise[i].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            greedy_mask = torch.tensor(greedy, device=device)
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled


def sampled_logprob(lp: torch.Tensor, token: int, num_top: int) -> tuple[float, int, list[tuple[int, float]]]:
    """(token's logprob, its rank, the top `num_top` (id, logprob)) from one row of log-softmax."""
    value = lp[token]
    rank = int((lp > value).sum()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        vals, ids = lp.topk(num_top)
        # a grammar may allow fewer tokens than asked for: the others cannot be chosen
        top = [(i, v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True) if v != -inf]
    return float(value), rank, top


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (HF-style, prompt and output), OpenAI presence/frequency (output only),
    then OpenAI's logit_bias (its ids are checked against the vocabulary when the request comes in;
    a token the grammar forbids stays forbidden: -inf plus a bias is -inf), then vLLM's
    allowed_token_ids (all others -inf)."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            out = seq.output_token_ids
            if out:
                counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab)[:vocab]
                counts = counts.to(logits.device, logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    logits.dtype
                )
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row, ids] += bias
        if seq.bad_word_ids:
            _forbid_bad_words(logits, row, seq)
        if p.allowed_token_ids is not None:  # every other token forbidden (the ids are in the vocabulary)
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=logits.device)
            kept = logits[row, ids]
            logits[row] = float("-inf")
            logits[row, ids] = kept
    return logits


def _forbid_bad_words(logits: torch.Tensor, row: int, seq: Sequence) -> None:
    """vLLM's bad_words: each word's last token is -inf where the output ends with the rest of it (a
    one-token word: always). Not where that leaves nothing to sample (a grammar's only token)."""
    tokens, made = seq.token_ids, seq.num_output_tokens  # the output's tail read in place, not copied
    banned = [
        ids[-1]
        for ids in seq.bad_word_ids
        if len(ids) == 1 or (made >= len(ids) - 1 and tuple(tokens[1 - len(ids) :]) == ids[:-1])
    ]
    banned = [t for t in banned if t < logits.shape[1]]
    if not banned:
        return
    index = torch.tensor(banned, dtype=torch.int64, device=logits.device)
    kept = logits[row, index].clone()
    logits[row, index] = float("-inf")
    if not bool(torch.isfinite(logits[row]).any()):
        logits[row, index] = kept


def mask_stop_tokens_before_min(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid EOS and stop tokens while a sequence has fewer than min_tokens outputs.

    Not where a grammar allows nothing else: its output is complete, and a row of -inf has no
    token to sample (a grammar that allows only EOS ends the sequence before this step).
    """
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            ids = [t for t in seq.stop_token_ids if t < vocab]
            if not ids:
                continue
            if seq.guided is not None or seq.params.allowed_token_ids is not None:
                masked = logits[row].clone()
                masked[ids] = float("-inf")
                if not bool(torch.isfinite(masked).any()):
                    continue
            logits[row, ids] = float("-inf")
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask tokens outside each row's top-k, nucleus (top-p) and min-p sets with -inf."""
    vocab = logits.shape[1]
    ks = [min(s.params.effective_top_k or vocab, vocab) for s in seqs]  # past the vocabulary: all of it
    ps = [s.params.top_p for s in seqs]
    min_ps = [s.params.min_p for s in seqs]
    device = logits.device
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_ps, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    mask = ranks >= torch.tensor(ks, device=device)[:, None]
    if any(p < 1.0 for p in ps):
        sorted_probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        mask |= cum_before >= torch.tensor(ps, device=device)[:, None]
    mask[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
