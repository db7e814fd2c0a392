"""The PostgreSQL broker's rate limits (``SupportsRateLimits``): ``broker_rates`` (one row per
rated queue) and ``broker_rate_starts`` (the sliding-window log, one row per start; step 4 of
the broker's migrations).

A take is one transaction on one connection: it first takes the queue's transaction-scoped
advisory lock (``pg_advisory_xact_lock`` on a hash of schema and queue, its own key space
apart from the limits' lock), so the takes of one queue take turns across every process and
the count each reads is exact; then it drops the starts that left the window, reads the ones
in it, and logs what fits. The clock is the server's, read once the lock is held
(``clock_timestamp()``, not the transaction's start: a take that waited for the lock reads the
time after the wait).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from .._rates import KEY_SEPARATOR, grant, log_name, window_fields
from ._operations import UNBOUNDED

if TYPE_CHECKING:
    from ..._postgres import PgPool

__all__ = ["RATE_MIGRATION", "RATE_PER_KEY_MIGRATION", "Rates"]

#: The broker's migration step 4: the rates and their logs.
RATE_MIGRATION = """
CREATE TABLE {schema}.broker_rates (
    queue text COLLATE "C" PRIMARY KEY,
    count bigint NOT NULL CHECK (count >= 1),
    per double precision NOT NULL CHECK (per > 0)
);
CREATE TABLE {schema}.broker_rate_starts (
    pk bigserial PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    at double precision NOT NULL
);
CREATE INDEX broker_rate_starts_queue ON {schema}.broker_rate_starts (queue, at);
"""

#: The broker's migration step 5: whether a rate holds per key (what the operator's view
#: counts: the keyless log, or each key's). A constant default: added without a rewrite.
RATE_PER_KEY_MIGRATION = """
ALTER TABLE {schema}.broker_rates ADD COLUMN per_key boolean NOT NULL DEFAULT false;
"""

_NOW = "extract(epoch FROM clock_timestamp())::float8"


def rate_lock_key(schema: str, queue: str) -> int:
    """The key of ``queue``'s rate lock: a hash of schema and queue."""
    digest = hashlib.blake2b(f"{schema}\x00{queue}".encode(), digest_size=8, person=b"dt-rate")
    return int.from_bytes(digest.digest(), "big", signed=True)


class Rates:
    """The statements of one schema's rate limits (``schema``: quoted)."""

    def __init__(self, schema: str, raw_schema: str) -> None:
        s = schema
        self._raw_schema = raw_schema
        self._set = (
            f"INSERT INTO {s}.broker_rates (queue, count, per, per_key) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (queue) DO UPDATE SET count = excluded.count, per = excluded.per, "
            "per_key = excluded.per_key"
        )
        self._delete = f"DELETE FROM {s}.broker_rates WHERE queue = $1"
        self._lock_and_read = (
            f"SELECT r.count, r.per, {_NOW} FROM (SELECT pg_advisory_xact_lock($2::bigint)) AS l, "
            f"{s}.broker_rates AS r WHERE r.queue = $1"
        )
        self._prune_and_list = (
            f"WITH gone AS (DELETE FROM {s}.broker_rate_starts WHERE queue = $1 AND at <= $2) "
            f"SELECT at FROM {s}.broker_rate_starts WHERE queue = $1 AND at > $2 ORDER BY at"
        )
        self._prune_keys = (
            f"DELETE FROM {s}.broker_rate_starts WHERE queue > $1 AND queue < $2 AND at <= $3"
        )
        self._log = (
            f"INSERT INTO {s}.broker_rate_starts (queue, at) "
            "SELECT $1, $2 FROM generate_series(1, $3::bigint)"
        )
        self._give_back = (
            f"DELETE FROM {s}.broker_rate_starts WHERE pk IN (SELECT pk FROM "
            f"{s}.broker_rate_starts WHERE queue = $1 AND at = $2 ORDER BY pk DESC LIMIT $3)"
        )
        self._window = (
            f"SELECT r.count, r.per, r.per_key, (SELECT count(*) FROM {s}.broker_rate_starts AS t "
            f"WHERE t.queue = $1 AND t.at > {_NOW} - r.per), {_NOW} "
            f"FROM {s}.broker_rates AS r WHERE r.queue = $1"
        )
        self._key_windows = (
            f"SELECT count(*) FROM {s}.broker_rate_starts "
            "WHERE queue > $1 AND queue < $2 AND at > $3 GROUP BY queue"
        )

    async def store(
        self, pool: PgPool, queue: str, count: int | None, per: float, per_key: bool = False
    ) -> None:
        if count is None:
            await pool.execute(self._delete, queue, command_timeout=UNBOUNDED)
        else:
            await pool.execute(self._set, queue, count, per, per_key, command_timeout=UNBOUNDED)

    async def take(
        self, pool: PgPool, queue: str, want: int, key: str | None = None
    ) -> tuple[int, float, float]:
        """``(granted, retry_after, at)``; a queue without a rate: ``(want, 0, 0)``. With
        ``key``: the key's log (``log_name``, under the queue's same lock), held to the
        queue's rate; the expired starts of every key of the queue are dropped too."""
        async with pool.transaction() as conn:
            rows = (
                await conn.execute(
                    self._lock_and_read,
                    queue,
                    rate_lock_key(self._raw_schema, queue),
                    command_timeout=UNBOUNDED,
                )
            ).rows
            if not rows:
                return want, 0.0, 0.0
            count, per, now = int(rows[0][0]), float(rows[0][1]), float(rows[0][2])
            if key is not None:
                await conn.execute(
                    self._prune_keys,
                    queue + KEY_SEPARATOR,
                    queue + chr(ord(KEY_SEPARATOR) + 1),
                    now - per,
                    command_timeout=UNBOUNDED,
                )
            log = log_name(queue, key)
            times = [
                float(row[0])
                for row in (
                    await conn.execute(
                        self._prune_and_list, log, now - per, command_timeout=UNBOUNDED
                    )
                ).rows
            ]
            granted, retry_after = grant(times, now, want, count, per)
            if granted:
                await conn.execute(self._log, log, now, granted, command_timeout=UNBOUNDED)
            return granted, retry_after, now

    async def give_back(self, pool: PgPool, queue: str, at: float, n: int) -> None:
        await pool.execute(self._give_back, queue, at, n, command_timeout=UNBOUNDED)

    async def window(self, pool: PgPool, queue: str) -> dict[str, Any]:
        """The rate fields of ``queue``'s ``QueueStats`` (``window_fields``): a per-key rate
        counts each key's log (one grouped scan of the queue's keys, on the index)."""
        row = await pool.fetchrow(self._window, queue, command_timeout=UNBOUNDED)
        if row is None:
            return {}
        count, per = int(row[0]), float(row[1])
        if not row[2]:
            return window_fields(count, per, False, [int(row[3])])
        rows = await pool.fetch(
            self._key_windows,
            queue + KEY_SEPARATOR,
            queue + chr(ord(KEY_SEPARATOR) + 1),
            float(row[4]) - per,
            command_timeout=UNBOUNDED,
        )
        return window_fields(count, per, True, [int(r[0]) for r in rows])
