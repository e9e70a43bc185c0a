"""gateway/errors.py: every error a client may get is answered by one mapping, from its attributes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import orjson

from gateway.errors import NOSNIFF, error_answer
from gateway.governance.budgets import Budget, BudgetExceededError
from gateway.governance.keys import AuthError
from gateway.governance.ratelimit import Limit, RateLimitedError, refusal
from gateway.routing.router import NoRouteError


def test_a_rate_limit_error_is_typed_by_what_its_limit_counts_not_by_its_text() -> None:
    requests = Limit("team:tokens:rpm", 1, 1, "requests per minute for team tokens")  # "tokens" in the text
    assert refusal(5.0, requests).type == "requests"
    tokens = Limit("key:k:tpm", 10, 1, "tokens per minute for this key", "tokens")
    assert refusal(5.0, tokens).type == "tokens"


def test_an_error_answer_carries_the_errors_status_body_and_headers() -> None:
    status, headers, body = error_answer(RateLimitedError("rate limit reached", 2.5, "tokens"))
    assert (status, headers) == (429, [NOSNIFF, (b"retry-after", b"3")])
    assert orjson.loads(body) == {"error": {"message": "rate limit reached", "type": "tokens", "param": None,
                                            "code": "rate_limit_exceeded"}}  # fmt: skip
    assert error_answer(NoRouteError("nothing may serve 'm'")).status == 503
    assert orjson.loads(error_answer(NoRouteError("x")).body)["error"]["param"] == "model"
    unknown = AuthError(401, "Incorrect API key provided", "invalid_api_key")
    assert error_answer(unknown)[:2] == (401, [NOSNIFF])


def test_a_spent_budget_tells_when_it_resets() -> None:
    reset = datetime.now(UTC) + timedelta(seconds=90)
    status, headers, body = error_answer(BudgetExceededError(Budget("key", "k1", Decimal(1), "daily"), reset))
    assert status == 429 and orjson.loads(body)["error"]["type"] == "insufficient_quota"
    assert dict(headers)[b"x-budget-reset"] == reset.isoformat().encode()
    assert 89 <= int(dict(headers)[b"retry-after"]) <= 90


def test_only_answers_that_waiting_cannot_change_tell_the_sdks_not_to_retry() -> None:
    budget = Budget("key", "k1", Decimal(1), "daily")
    soon, later = (datetime.now(UTC) + timedelta(seconds=s) for s in (30, 3600))
    assert b"x-should-retry" not in dict(error_answer(BudgetExceededError(budget, soon)).headers)
    assert dict(error_answer(BudgetExceededError(budget, later)).headers)[b"x-should-retry"] == b"false"
    total = Budget("key", "k1", Decimal(1), "total")
    assert dict(error_answer(BudgetExceededError(total, None)).headers)[b"x-should-retry"] == b"false"
    never = BudgetExceededError(budget, soon, reserved=2 * 10**12)  # $2: more than the whole budget
    assert dict(error_answer(never).headers)[b"x-should-retry"] == b"false"
    tokens = Limit("key:k:tpm", 100, 500, "tokens per minute for this key", "tokens")  # costs 500 of 100
    assert dict(error_answer(refusal(5.0, tokens)).headers)[b"x-should-retry"] == b"false"
    assert b"retry-after" not in dict(error_answer(refusal(5.0, tokens)).headers)
    requests = Limit("key:k:rpm", 10, 1, "requests per minute for this key")
    assert b"x-should-retry" not in dict(error_answer(refusal(5.0, requests)).headers)
