"""Failover along a chain, in-process with scripted pools: what is retried, in which order, and what the
client gets when everything fails."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from gateway.backends.base import Attempt, UpstreamReply, UpstreamStream, UpstreamUnavailableError
from gateway.config.policy import Policy, Retries, Timeouts, parse_policy
from gateway.pipeline.failover import ChainExhaustedError, Failover, backoff
from gateway.pipeline.served import Served
from gateway.routing.router import RouteDecision

POLICY = """
backends:
  pool: {type: engine, urls: ["http://r1", "http://r2"]}
  hosted: {type: hosted, model: openai/x}
models:
  local: {backend: pool}
  frontier: {backend: hosted}
"""


ROLE = 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
EMPTY = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"logprobs":null,"finish_reason":null}]}'
LOGPROBS = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"logprobs":{"content":[]}}]}'
ROLE_1 = 'data: {"choices":[{"index":1,"delta":{"role":"assistant","content":""}}]}'
ROLE_IDS = 'data: {"prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant"}}]}'
REFUSAL = 'data: {"choices":[{"index":0,"delta":{"refusal":"I cannot"}}]}'
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}'


class ScriptedPool:
    """Each call takes the next scripted outcome for the replica it lands on."""

    def __init__(self, name: str, replicas: list[str], script: dict[str, list[Any]],
                 timeouts: Timeouts | None = None) -> None:  # fmt: skip
        self.name, self.replicas, self.script = name, replicas, script
        self._timeouts = timeouts or Timeouts(first_token=0.2, total=0.5)
        self.calls: list[str] = []
        self.given: list[Timeouts | None] = []  # the timeouts each call was given
        self.reason: str | None = None

    @property
    def timeouts(self) -> Timeouts:
        return self._timeouts

    @property
    def unavailable_reason(self) -> str | None:
        return self.reason

    def _next(self, avoid: frozenset[str]) -> tuple[str, Any]:
        free = [r for r in self.replicas if r not in avoid]
        if not free:
            raise UpstreamUnavailableError(f"{self.name}: no replica left", timeout=False)  # as EnginePool
        replica = free[0]
        self.calls.append(replica)
        outcomes = self.script[replica]
        return replica, outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]

    async def send(self, path: str, body: bytes, timeouts: Timeouts | None = None,
                   avoid: frozenset[str] = frozenset(), headers: Any = None) -> UpstreamReply:  # fmt: skip
        replica, outcome = self._next(avoid)
        self.given.append(timeouts)
        if outcome == "hang":  # accepts, never answers: the call's own total runs out
            await asyncio.sleep((timeouts or self.timeouts).total)
            outcome = "timeout"
        if outcome in ("refused", "timeout"):
            raise UpstreamUnavailableError(
                f"{replica} {outcome}", timeout=outcome == "timeout", deployment=replica
            )
        if outcome == "garbage":  # a 200 no client's SDK can read
            return UpstreamReply(200, b'{"choices": "nope"}', replica)
        if outcome == 200:
            return UpstreamReply(200, b'{"choices": [{"message": {"content": "hi"}}]}', replica)
        return UpstreamReply(int(outcome), b'{"status": %d}' % int(outcome), replica)

    @asynccontextmanager
    async def stream(self, path: str, body: bytes, timeouts: Timeouts | None = None,
                     avoid: frozenset[str] = frozenset(),
                     headers: Any = None) -> AsyncIterator[UpstreamStream]:  # fmt: skip
        replica, outcome = self._next(avoid)
        if outcome == "refused":
            raise UpstreamUnavailableError(f"{replica} refused", timeout=False, deployment=replica)
        if outcome == "slow":  # its head takes most of first_token, its first token the rest and more
            await asyncio.sleep(0.12)

        async def lines() -> AsyncIterator[str]:
            yield ROLE_IDS if outcome == "ids" else ROLE
            if outcome in ("two", "two_stall"):  # n=2: a role chunk per choice
                yield ROLE_1
            if outcome in ("stall", "two_stall"):
                await asyncio.sleep(10)
            if outcome == "slow":
                await asyncio.sleep(0.12)
            if outcome == "extras":  # before the first token: an empty role delta, then one with logprobs
                yield EMPTY
                yield LOGPROBS
            if outcome == "refusal":
                yield REFUSAL
            yield TOKEN
            yield "data: [DONE]"

        yield UpstreamStream(200, lines(), b"", replica)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _setup(
    script: dict[str, list[Any]], hosted: list[Any] | None = None
) -> tuple[Failover, ScriptedPool, ScriptedPool]:
    policy: Policy = parse_policy(POLICY)
    pool = ScriptedPool("pool", ["http://r1", "http://r2"], script)
    frontier = ScriptedPool("hosted", ["openai/x"], {"openai/x": hosted or [200]})
    return Failover(policy, {"pool": pool, "hosted": frontier}, random.Random(0)), pool, frontier


def _decision(chain: tuple[str, ...] = ("local", "frontier"), count: int = 0) -> RouteDecision:
    return RouteDecision("auto", chain, "test", retries=Retries(count=count, backoff=0.001))


def test_a_failed_replica_moves_to_the_other_replica_before_the_next_model() -> None:
    failover, _, frontier = _setup({"http://r1": ["refused"], "http://r2": [200]})
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {"messages": []}))
    assert (served.backend, served.deployment) == ("pool", "http://r2")
    assert [a.describe() for a in served.attempts] == ["local@http://r1=unreachable"]
    assert frontier.calls == []


def test_every_replica_failing_moves_to_the_next_model_after_retries() -> None:
    failover, pool, _ = _setup({"http://r1": [503], "http://r2": ["timeout"]})
    served = asyncio.run(failover.send(_decision(count=1), "/v1/chat/completions", {"messages": []}))
    assert served.backend == "hosted"
    assert pool.calls == ["http://r1", "http://r2", "http://r1", "http://r2"]  # one retry round


def test_429_moves_on_at_once_and_4xx_is_returned_as_is() -> None:
    failover, pool, _ = _setup({"http://r1": [429], "http://r2": [200]})
    served = asyncio.run(failover.send(_decision(count=3), "/v1/chat/completions", {}))
    assert served.backend == "hosted" and pool.calls == ["http://r1"]
    failover, pool, _ = _setup({"http://r1": [400], "http://r2": [200]})
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert served.reply is not None and served.reply.status == 400 and served.backend == "pool"


@pytest.mark.parametrize("status", [401, 403, 404, 405, 407])
def test_an_upstream_refusing_the_gateway_itself_moves_to_another_replica_then_model(status: int) -> None:
    """Its credentials or the model's upstream name are wrong there: not the client's request."""
    failover, pool, _ = _setup({"http://r1": [status], "http://r2": [200]})
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert (served.backend, served.deployment) == ("pool", "http://r2")
    failover, pool, _ = _setup({"http://r1": [status], "http://r2": [status]})
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert served.backend == "hosted" and pool.calls == ["http://r1", "http://r2"]


def test_when_everything_fails_the_last_answer_or_the_kind_of_failure_is_reported() -> None:
    failover, _, _ = _setup({"http://r1": ["refused"], "http://r2": ["refused"]}, hosted=[503])
    with pytest.raises(ChainExhaustedError) as info:
        asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert info.value.last is not None and info.value.last.status == 503
    failover, _, _ = _setup({"http://r1": ["timeout"], "http://r2": ["timeout"]})
    with pytest.raises(ChainExhaustedError) as info:
        asyncio.run(failover.send(_decision(("local",)), "/v1/chat/completions", {}))
    assert info.value.last is None and info.value.timeout and not info.value.unavailable


def test_unavailable_models_are_skipped_without_a_call() -> None:
    failover, pool, frontier = _setup({"http://r1": [200], "http://r2": [200]})
    pool.reason = "no healthy replica"
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert served.backend == "hosted" and pool.calls == []
    assert served.attempts[0].outcome.startswith("unavailable")
    frontier.reason = "set OPENAI_API_KEY"
    with pytest.raises(ChainExhaustedError) as info:
        asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert info.value.unavailable and "OPENAI_API_KEY" in info.value.detail()
    assert "OPENAI_API_KEY" not in str(info.value) and "http://" not in str(info.value)  # the client's text


def test_only_what_came_before_the_answer_is_reported_in_chain_order() -> None:
    failover, _, frontier = _setup({"http://r1": [200], "http://r2": [200]})
    frontier.reason = "set OPENAI_API_KEY"  # after the model that answers: no failover happened
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert served.backend == "pool" and served.attempts == []
    lacks = Attempt("frontier", "hosted", None, "lacks logprobs", called=False)
    late = replace(_decision(("local",)), skipped=(lacks,), skipped_at=(1,))  # skipped by the router, after
    assert asyncio.run(failover.send(late, "/v1/chat/completions", {})).attempts == []
    early = replace(_decision(("local",)), skipped=(lacks,), skipped_at=(0,))
    assert [a.model for a in asyncio.run(failover.send(early, "/v1/chat/completions", {})).attempts] == [
        "frontier"
    ]
    failover, _, _ = _setup({"http://r1": [500], "http://r2": [500]}, hosted=[503])
    between = replace(_decision(), skipped=(lacks,), skipped_at=(1,))
    with pytest.raises(ChainExhaustedError) as info:
        asyncio.run(failover.send(between, "/v1/chat/completions", {}))
    assert [a.model for a in info.value.attempts] == ["local", "local", "frontier", "frontier"]  # as walked
    assert [a.called for a in info.value.attempts] == [True, True, False, True]


def test_each_candidate_gets_its_own_upstream_model_name() -> None:
    failover, _, _ = _setup({"http://r1": [200], "http://r2": [200]})
    assert failover._upstream_body({"model": "auto", "x": 1}, "frontier") == {"model": "openai/x", "x": 1}


def test_a_stream_stalled_after_its_role_chunk_fails_over_before_anything_is_sent() -> None:
    failover, _, _ = _setup({"http://r1": ["stall"], "http://r2": ["ok"]})
    served = asyncio.run(failover.stream(_decision(), "/v1/chat/completions", {}))
    assert served.deployment == "http://r2"
    assert served.attempts[0].outcome == "first token timeout"
    assert served.head[-1].endswith('"content":"hi"}}]}') and len(served.head) == 2


def test_total_bounds_the_whole_request_not_each_of_its_attempts() -> None:
    """Two replicas that accept and never answer, then the next model: `total` (0.5 s) is the whole
    request's (was: each call's, 504 after 2 x total on a two-replica pool, and more with retries)."""
    for script in (
        {"http://r1": ["hang"], "http://r2": ["hang"]},
        {"http://r1": ["refused"], "http://r2": ["hang"]},
    ):
        failover, pool, frontier = _setup(script, hosted=["hang"])
        loop = asyncio.new_event_loop()
        start = loop.time()
        with pytest.raises(ChainExhaustedError) as exhausted:
            loop.run_until_complete(failover.send(_decision(count=2), "/v1/chat/completions", {}))
        took = loop.time() - start
        loop.close()
        assert exhausted.value.status == 504 and 0.45 < took < 0.8, took
        assert pool.given[0] is None  # the first call: the pool's own timeouts
        for given in pool.given[1:] + frontier.given:  # a later one: what is left of them
            assert given is not None and given.total < 0.5


def test_a_fallback_with_a_longer_total_is_still_tried_when_the_first_models_is_spent() -> None:
    failover, pool, frontier = _setup({"http://r1": ["hang"], "http://r2": [200]}, hosted=[200])
    frontier._timeouts = Timeouts(first_token=0.2, total=10)
    served = asyncio.run(failover.send(_decision(), "/v1/chat/completions", {}))
    assert served.backend == "hosted" and pool.calls == ["http://r1"]  # r2: no time left in pool's 0.5 s
    assert frontier.given[0] is not None and 9 < frontier.given[0].total < 10


def test_a_200_that_is_no_answer_is_tried_on_another_replica_and_at_last_a_502() -> None:
    failover, pool, _ = _setup({"http://r1": ["garbage"], "http://r2": [200]})
    served = asyncio.run(failover.send(_decision(("local",)), "/v1/chat/completions", {}))
    assert served.deployment == "http://r2" and served.reply is not None and served.reply.answer is not None
    assert [a.describe() for a in served.attempts] == ["local@http://r1=invalid answer"]
    failover, pool, _ = _setup({"http://r1": ["garbage"], "http://r2": ["garbage"]})
    with pytest.raises(ChainExhaustedError) as exhausted:
        asyncio.run(failover.send(_decision(("local",)), "/v1/chat/completions", {}))
    assert (exhausted.value.status, exhausted.value.code) == (502, "upstream_invalid_response")
    assert pool.calls == ["http://r1", "http://r2"]


def test_first_token_bounds_a_streams_head_and_its_first_token_together() -> None:
    """A head after 0.12 s and a first token 0.12 s later: 0.24 s, past first_token (0.2 s), fails
    over (was: each wait bounded by it on its own, so up to twice it)."""
    failover, _, _ = _setup({"http://r1": ["slow"], "http://r2": ["ok"]})
    served = asyncio.run(failover.stream(_decision(), "/v1/chat/completions", {}))
    assert served.deployment == "http://r2"
    assert served.attempts[0].outcome == "first token timeout"


@pytest.mark.parametrize("sent", [True, False], ids=["opening sent", "opening kept"])
def test_a_stream_commits_its_head_once_at_the_first_event_of_the_first_replica_that_sends_one(
    sent: bool,
) -> None:
    failover, _, _ = _setup({"http://r1": ["refused"], "http://r2": ["stall"]}, hosted=["ok"])
    commits: list[tuple[str, str, list[str], str | None]] = []

    async def commit(backend: str, deployment: str, attempts: list[Attempt], line: str | None) -> bool:
        commits.append((backend, deployment, [a.describe() for a in attempts], line))
        return sent

    served = asyncio.run(failover.stream(_decision(), "/v1/chat/completions", {}, commit=commit))
    # r1 sent nothing; r2's role chunk committed the head, then it stalled: the hosted model served
    assert commits == [("pool", "http://r2", ["local@http://r1=unreachable"], ROLE)]
    assert served.backend == "hosted" and served.attempts[-1].outcome == "first token timeout"
    # the client has r2's role chunk when it went with the head: the hosted one's is not sent again
    assert served.head == ([TOKEN] if sent else [ROLE, TOKEN])


def _committed(script: dict[str, list[Any]], sends: bool = True) -> tuple[Served, list[str | None]]:
    """A stream along `script` whose commit sends the opening line it is offered (unless not
    `sends`): what served, and every line offered (None: the first event was no opening)."""
    failover, _, _ = _setup(script)
    offered: list[str | None] = []

    async def commit(backend: str, deployment: str, attempts: list[Attempt], line: str | None) -> bool:
        offered.append(line)
        return sends and line is not None

    served = asyncio.run(failover.stream(_decision(), "/v1/chat/completions", {}, commit=commit))
    return served, offered


def test_after_an_opening_went_out_only_events_carrying_nothing_are_dropped_before_the_first_token() -> None:
    served, _ = _committed({"http://r1": ["stall"], "http://r2": ["extras"]})
    # r1's role chunk went out; r2's two openings of that choice carry nothing the client lacks
    assert served.deployment == "http://r2" and served.head == [LOGPROBS, TOKEN]


def test_with_two_choices_each_keeps_its_role_chunk_and_only_openings_the_client_has_are_dropped() -> None:
    served, _ = _committed({"http://r1": ["two_stall"], "http://r2": ["two"]})
    # r1's choice-0 role chunk went with the head; its choice-1 one never reached the client, so r2's
    # is kept, and r2's choice-0 one is dropped
    assert served.deployment == "http://r2" and served.head == [ROLE_1, TOKEN]
    served, _ = _committed({"http://r1": ["two"], "http://r2": ["ok"]})
    assert served.head == [ROLE_1, TOKEN]  # the serving upstream's own openings are never dropped


def test_an_opening_with_fields_of_its_own_is_not_sent_early_nor_dropped() -> None:
    served, offered = _committed({"http://r1": ["ids"], "http://r2": ["ok"]})
    assert offered == [None] and served.head == [ROLE_IDS, TOKEN]


def test_a_token_or_a_refusal_is_never_sent_as_an_opening_and_a_refusal_is_a_first_token() -> None:
    served, offered = _committed({"http://r1": ["refusal"], "http://r2": ["ok"]}, sends=False)
    assert offered == [ROLE]
    assert served.head == [ROLE, REFUSAL]  # the refusal ends the wait: it is the answer's first output


def test_backoff_doubles_caps_and_jitters_within_bounds() -> None:
    retries = Retries(count=5, backoff=0.1, max_backoff=0.3, jitter=0.5)
    rng = random.Random(1)
    for round_, base in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)):
        value = backoff(retries, round_, rng)
        assert base * 0.5 <= value <= base * 1.5


def test_first_token_is_told_once_the_served_streams_head_and_never_a_failed_candidates() -> None:
    failover, _, _ = _setup({"http://r1": ["stall"], "http://r2": ["ids"]})
    told: list[tuple[list[str], bool]] = []

    def first_token(head: list[str], resumable: bool) -> None:
        told.append((head, resumable))

    served = asyncio.run(failover.stream(_decision(), "/v1/chat/completions", {}, first_token=first_token))
    # r1's role chunk came, then it stalled: only r2's head, which served, is told, with whether the
    # stream resumes elsewhere should it break (an engine pool's does by default)
    assert served.deployment == "http://r2" and served.resume is not None
    assert told == [(served.head, True)] and served.head == [ROLE_IDS, TOKEN]
    told.clear()
    asyncio.run(
        failover.stream(_decision(("frontier",)), "/v1/chat/completions", {}, first_token=first_token)
    )
    assert told == [([ROLE, TOKEN], False)]  # a hosted model's stream is not resumed
