"""The PostgreSQL worker-key store: a table (``worker_keys``) in the backend's schema.

Expiry is on the server's clock (``clock_timestamp()``): a ``ttl`` is relative seconds, so no two
machines' clocks need to agree. Expired rows are invisible at once and deleted opportunistically,
a bounded batch per write (in the write's own round trip), as in the SQLite store.

Keys are ``text COLLATE "C"``: ordered by code point, as Python orders ``str``, so
``prefix <= key < bound`` (an index range) is exactly "``key`` starts with ``prefix``".

Open it on a pool whose owner closes it::

    async with open_pool(url) as pool:
        keys = await PostgresKeyStore.open(pool, schema="durable_trio")

Cancellation:
    A write, once sent, runs to its end (shielded, bounded); the cancellation is delivered after
    it. A read is cancelled at once (the pool makes its connection safe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import trio

from .._errors import BrokerUnavailable
from .._postgres._errors import PostgresError
from .._postgres._migrations import NO_TABLE, Migration, migrate, quote_ident, tables_missing
from ._contract import KeyEntry
from .sqlite import prefix_upper_bound

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

    from .._postgres import PgPool

__all__ = ["KEYS_MIGRATIONS", "PRUNE_BATCH", "PostgresKeyStore"]

#: Expired keys deleted per write at most.
PRUNE_BATCH: Final = 64

#: Seconds a write may take (waiting for a pooled connection included) before it gives up.
_WRITE_BOUND: Final = 60.0

#: The key store's steps of the schema (part ``"keys"``, see ``_postgres/_migrations.py``).
KEYS_MIGRATIONS: Final = (
    Migration(
        1,
        """
        CREATE TABLE {schema}.worker_keys (
            key text COLLATE "C" PRIMARY KEY,
            value bytea NOT NULL,
            expires_at double precision NOT NULL
        );
        CREATE INDEX worker_keys_expiry ON {schema}.worker_keys (expires_at)
        """,
        "worker keys with expiry",
    ),
)

_NOW: Final = "extract(epoch FROM clock_timestamp())::float8"

# Several rows in one statement: keys sorted and unique (an upsert may not touch a row twice,
# and one order of row locks keeps two writers of the same keys from deadlocking).
_PUT: Final = f"""
    INSERT INTO {{schema}}.worker_keys (key, value, expires_at)
    SELECT k, v, {_NOW} + t FROM unnest($1::text[], $2::bytea[], $3::float8[]) AS u (k, v, t)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
"""

# SKIP LOCKED: a row another writer is renewing is left to it. A NaN expiry (damage: PostgreSQL
# orders NaN above every number, so it would never expire) is expired, as SQLite reads it.
_PRUNE: Final = f"""
    DELETE FROM {{schema}}.worker_keys WHERE key IN (
        SELECT key FROM {{schema}}.worker_keys WHERE expires_at <= {_NOW} OR expires_at = 'NaN'
        ORDER BY expires_at LIMIT {PRUNE_BATCH} FOR UPDATE SKIP LOCKED
    )
"""

_REMOVE: Final = "DELETE FROM {schema}.worker_keys WHERE key = ANY($1::text[])"

_ENTRIES_FROM: Final = f"""
    SELECT key, value FROM {{schema}}.worker_keys
    WHERE key >= $1::text AND expires_at > {_NOW}
      AND expires_at <> 'NaN' ORDER BY key
"""

_ENTRIES_RANGE: Final = f"""
    SELECT key, value FROM {{schema}}.worker_keys
    WHERE key >= $1::text AND key < $2::text AND expires_at > {_NOW}
      AND expires_at <> 'NaN' ORDER BY key
"""


class PostgresKeyStore:
    """A :class:`~durable_trio.keys.KeyStore` in PostgreSQL; expiry on the server's clock.

    Create one with :meth:`open` (which brings its table up to date). The pool is the caller's:
    :meth:`aclose` does not close it.

    Attributes:
        schema: the PostgreSQL schema of its table.
    """

    def __init__(self, pool: PgPool, schema: str = "durable_trio") -> None:
        """Wrap ``pool``; use :meth:`open` instead (it applies the migrations).

        Raises:
            ConfigError: ``schema`` is not a plain lower-case identifier.
        """
        self._pool = pool
        self.schema = schema
        self._quoted = quote_ident(schema)
        self._closed = False

    @classmethod
    async def open(cls, pool: PgPool, schema: str = "durable_trio") -> PostgresKeyStore:
        """A store on ``pool``, its table created or brought up to date in ``schema``.

        Raises:
            ConfigError: a bad schema name.
            BrokerUnavailable: the server cannot be reached.
            BrokerError: the migrations failed, or the schema is newer than this code.
        """
        store = cls(pool, schema)
        await migrate(pool, schema, "keys", KEYS_MIGRATIONS)
        return store

    def _sql(self, template: str) -> str:
        return template.replace("{schema}", self._quoted)

    def _missing(self, error: PostgresError) -> Exception:
        """``error``, or the :class:`~durable_trio.StoreLost` of a table dropped under this
        process (the broker's watch on the store's identity raises the alarm)."""
        return tables_missing(self.schema, error) if error.sqlstate in NO_TABLE else error

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable(f"the PostgreSQL key store in schema {self.schema!r} is closed")

    async def _write(self, statement: str, params: Sequence[Any]) -> None:
        """``statement`` and a prune, in one round trip and one transaction; shielded and
        bounded (see the module docs)."""
        self._check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.move_on_after(_WRITE_BOUND, shield=True) as bound:
            try:
                await self._pool.pipeline(
                    [(self._sql(statement), params), (self._sql(_PRUNE), ())]
                )
            except PostgresError as error:
                raise self._missing(error) from error
        if bound.cancelled_caught:
            raise BrokerUnavailable(
                f"the PostgreSQL key store did not write within {_WRITE_BOUND:g} s"
            )
        await trio.lowlevel.checkpoint_if_cancelled()

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds (from now, on the server's clock)
        unless written again."""
        await self.put_many([(key, value, ttl)])

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Write every ``(key, value, ttl)`` in one statement (a key given twice: the last)."""
        latest = {key: (bytes(value), float(ttl)) for key, value, ttl in items}
        keys = sorted(latest)
        await self._write(_PUT, (keys, [latest[k][0] for k in keys], [latest[k][1] for k in keys]))

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        await self._write(_REMOVE, (sorted(set(keys)),))

    async def entries(self, prefix: str) -> list[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key (an index range scan)."""
        self._check_open()
        bound = prefix_upper_bound(prefix)
        try:
            if bound is None:
                rows = await self._pool.fetch(self._sql(_ENTRIES_FROM), prefix)
            else:
                rows = await self._pool.fetch(self._sql(_ENTRIES_RANGE), prefix, bound)
        except PostgresError as error:
            raise self._missing(error) from error
        return [KeyEntry(str(key), bytes(value)) for key, value in rows]

    async def aclose(self) -> None:
        """Stop using the pool (which stays open: it is the caller's). Idempotent."""
        self._closed = True
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> PostgresKeyStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
