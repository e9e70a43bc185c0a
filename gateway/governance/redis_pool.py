"""Redis clients for the shared counters: one blocking connection pool each, sized for the gateway.

redis-py's default pool holds 100 connections and raises at once when all are busy. Every
admission takes a connection for one script call, so past 100 concurrent requests per replica
the limiter and the budget store saw "Too many connections", treated it as Redis being down and
failed open (rate limits skipped) or closed (budgets answering 503). A BlockingConnectionPool
instead makes the request wait, up to `timeout` seconds, for a connection to come back: a burst
is served slightly later, never unchecked. Only a wait past the timeout counts as an outage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config.settings import GatewaySettings

DEFAULT_MAX_CONNECTIONS = 512  # per client (the limiter and the budget store have one each), per replica
DEFAULT_POOL_TIMEOUT = 5.0  # seconds a request waits for a free connection before Redis counts as down
# Seconds for one command or connection attempt. The clock runs on the event loop: under a burst
# the loop may take a second or more to come back to a reply Redis sent at once, and a 1 s timeout
# then failed healthy requests (budgets 503) at 400 concurrent requests per replica.
DEFAULT_SOCKET_TIMEOUT = 5.0
HEALTH_CHECK_SECONDS = 5  # a connection idle this long is PINGed before it carries a command


@dataclass(frozen=True)
class RedisPoolConfig:
    """How many connections one Redis client may open, and how long a caller waits for a free one."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    timeout: float = DEFAULT_POOL_TIMEOUT
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT

    def __post_init__(self) -> None:
        assert self.max_connections >= 1, self.max_connections
        assert self.timeout > 0 and self.socket_timeout > 0, (self.timeout, self.socket_timeout)

    def client(self, url: str) -> Any:
        """A `redis.asyncio.Redis` that owns its blocking pool (closing the client closes the pool)."""
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=self.max_connections,
            timeout=self.timeout,
            socket_timeout=self.socket_timeout,
            socket_connect_timeout=self.socket_timeout,
            # A pooled connection Redis (its `timeout`, a restart, a proxy's idle limit) closed while
            # it sat idle failed the next command on it, and a healthy Redis was taken for an
            # outage (budgets 503, limits skipped) until every dead connection had been used once.
            # Idle ones are checked before use, and a command whose connection turns out closed is
            # sent once more on a new one. Only a connection error is retried: after a timeout,
            # Redis may have run the command (a reservation or a settle: not idempotent).
            health_check_interval=HEALTH_CHECK_SECONDS,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        return aioredis.Redis.from_pool(pool)


DEFAULT_POOL = RedisPoolConfig()  # immutable: safe as a shared default argument


def pool_config(settings: GatewaySettings) -> RedisPoolConfig:
    """The pool set by GATEWAY_REDIS_MAX_CONNECTIONS, _REDIS_POOL_TIMEOUT and _REDIS_SOCKET_TIMEOUT."""
    return RedisPoolConfig(
        settings.redis_max_connections, settings.redis_pool_timeout, settings.redis_socket_timeout
    )
