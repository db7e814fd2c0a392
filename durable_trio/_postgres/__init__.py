"""A thin Trio-native PostgreSQL driver on psycopg 3's sans-I/O core (the PostgreSQL backend's
foundation; issue 32).

psycopg runs on asyncio or blocks; its protocol code is generators that yield what they wait
for. :mod:`._wait` drives them with Trio's own waits; :mod:`._connection` is one connection
(statements with ``$1`` parameters, transactions, and the cancellation rule every other module
relies on); :mod:`._pool` a small fixed-size pool; :mod:`._mux` several pipelined calls in
flight on one of its connections, answered in order; :mod:`._listen` one dedicated ``LISTEN``
connection that reconnects by itself, and :mod:`._hub` shares it between the parts of one
backend (callbacks by channel). Failures are translated at this edge into the project's
error tree (:mod:`._errors`).
"""

from __future__ import annotations

from ._batch import WriteBatcher
from ._connection import ConnectionStats, PgConnection, Result, connect, parse_conninfo
from ._errors import (
    PostgresAuthError,
    PostgresCommandTimeout,
    PostgresConflict,
    PostgresError,
    PostgresQueryCanceled,
    PostgresUnavailableError,
)
from ._hub import NotifyHub, open_notify_hub
from ._listen import Notification, NotificationsMissed, PgListener, open_listener
from ._migrations import (
    NO_TABLE,
    Migration,
    check_schema_name,
    migrate,
    quote_ident,
    schema_versions,
    tables_missing,
)
from ._mux import PgMux
from ._pool import PgPool, PoolStats, open_pool

__all__ = [
    "NO_TABLE",
    "ConnectionStats",
    "Migration",
    "Notification",
    "NotificationsMissed",
    "NotifyHub",
    "PgConnection",
    "PgListener",
    "PgMux",
    "PgPool",
    "PoolStats",
    "PostgresAuthError",
    "PostgresCommandTimeout",
    "PostgresConflict",
    "PostgresError",
    "PostgresQueryCanceled",
    "PostgresUnavailableError",
    "Result",
    "WriteBatcher",
    "check_schema_name",
    "connect",
    "migrate",
    "open_listener",
    "open_notify_hub",
    "open_pool",
    "parse_conninfo",
    "quote_ident",
    "schema_versions",
    "tables_missing",
]
