"""A thin Trio-native Redis client on hiredis's sans-IO parser.

One writer task per connection coalesces every queued command into one ``send_all``; one reader
task hands replies back in FIFO order; a small pool spreads callers over a few connections.
Failures are translated at this edge into the project's error tree: connection problems and
timeouts are :class:`~durable_trio._errors.BrokerUnavailable`, error replies are
:class:`RedisReplyError` (a :class:`~durable_trio._errors.BrokerError`), except the transient
ones (``-LOADING``, ``-BUSY``, ``-TRYAGAIN``...): :class:`RedisBusyReply`, unavailable too,
and refused credentials (``-WRONGPASS``, ``-NOAUTH``, ``-NOPERM``): :class:`RedisAuthError`, an
:class:`~durable_trio._errors.AuthenticationError`.
"""

from __future__ import annotations

from ._client import RedisClient, open_redis
from ._connection import Connection, ConnectionStats, RedisArg
from ._errors import RedisAuthError, RedisBusyReply, RedisCommandTimeout, RedisReplyError
from ._pubsub import Subscription
from ._script import Script
from ._url import RedisURL, parse_redis_url

__all__ = [
    "Connection",
    "ConnectionStats",
    "RedisArg",
    "RedisAuthError",
    "RedisBusyReply",
    "RedisClient",
    "RedisCommandTimeout",
    "RedisReplyError",
    "RedisURL",
    "Script",
    "Subscription",
    "open_redis",
    "parse_redis_url",
]
