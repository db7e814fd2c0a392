"""A thin Trio-native PostgreSQL driver on psycopg 3's sans-I/O core (the PostgreSQL backend's
foundation; issue 32).

psycopg runs on asyncio or blocks; its protocol code is generators that yield what they wait
for. :mod:`._wait` drives them with Trio's own waits; :mod:`._connection` is one connection
(statements with ``$1`` parameters, transactions, and the cancellation rule every other module
relies on); :mod:`._pool` a small fixed-size pool; :mod:`._listen` one dedicated ``LISTEN``
connection that reconnects by itself. Failures are translated at this edge into the project's
error tree (:mod:`._errors`).
"""

from __future__ import annotations

from ._connection import ConnectionStats, PgConnection, Result, connect, parse_conninfo
from ._errors import (
    PostgresAuthError,
    PostgresCommandTimeout,
    PostgresConflict,
    PostgresError,
    PostgresQueryCanceled,
    PostgresUnavailableError,
)
from ._listen import Notification, NotificationsMissed, PgListener, open_listener
from ._pool import PgPool, PoolStats, open_pool

__all__ = [
    "ConnectionStats",
    "Notification",
    "NotificationsMissed",
    "PgConnection",
    "PgListener",
    "PgPool",
    "PoolStats",
    "PostgresAuthError",
    "PostgresCommandTimeout",
    "PostgresConflict",
    "PostgresError",
    "PostgresQueryCanceled",
    "PostgresUnavailableError",
    "Result",
    "connect",
    "open_listener",
    "open_pool",
    "parse_conninfo",
]
