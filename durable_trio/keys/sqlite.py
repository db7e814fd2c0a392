"""The SQLite worker-key store: a table (``dt_keys``) in the broker's database file.

Expiry is on ``time.time()`` (the wall clock every process on the machine shares). Expired rows
are invisible at once and deleted opportunistically, a bounded batch per write.

Either open it on its own connection::

    keys = await SqliteKeyStore.open("/var/lib/app/durable.db")

or share the connection thread of a :class:`~durable_trio.brokers.sqlite.SqliteBroker` on the
same file (one thread and one connection for both; the connection closes when both did)::

    keys = await SqliteKeyStore.attach(broker)
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Final

import trio

from .._errors import BrokerUnavailable
from .._sqlite import ConnectionThread, Synchronous, open_connection
from ._contract import KeyEntry

if TYPE_CHECKING:
    import os
    import sqlite3
    from collections.abc import Sequence
    from types import TracebackType

    from ..brokers.sqlite import SqliteBroker

__all__ = ["SqliteKeyStore"]

#: Expired keys deleted per write at most.
PRUNE_BATCH: Final = 64

_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_keys (
        key TEXT PRIMARY KEY,
        value BLOB NOT NULL,
        expires_at REAL NOT NULL
    ) WITHOUT ROWID
    """,
    "CREATE INDEX IF NOT EXISTS dt_keys_expiry ON dt_keys (expires_at)",
)

_PUT: Final = """
    INSERT INTO dt_keys (key, value, expires_at) VALUES (?1, ?2, ?3)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
"""

_PRUNE: Final = """
    DELETE FROM dt_keys WHERE key IN (
        SELECT key FROM dt_keys WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2
    )
"""

_REMOVE: Final = "DELETE FROM dt_keys WHERE key = ?1"

_ENTRIES_FROM: Final = """
    SELECT key, value FROM dt_keys WHERE key >= ?1 AND expires_at > ?2 ORDER BY key
"""

_ENTRIES_RANGE: Final = """
    SELECT key, value FROM dt_keys WHERE key >= ?1 AND key < ?2 AND expires_at > ?3 ORDER BY key
"""


def prefix_upper_bound(prefix: str) -> str | None:
    """The least string greater than every string that starts with ``prefix``.

    SQLite compares ``TEXT`` as UTF-8 bytes, which orders like code points (and like Python's
    ``str``), so ``prefix <= key < bound`` is exactly "``key`` starts with ``prefix``".

    Args:
        prefix: the prefix.

    Returns:
        The bound, or ``None`` when there is none (an empty prefix, or one made only of
        ``U+10FFFF``): then every key from ``prefix`` on matches.
    """
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if code <= 0x10FFFF:
            if 0xD800 <= code <= 0xDFFF:
                code = 0xE000  # surrogates cannot be stored; skip over them
            chars[-1] = chr(code)
            return "".join(chars)
        chars.pop()
    return None


def _create_schema(db: sqlite3.Connection) -> None:
    for statement in _SCHEMA:
        db.execute(statement)


def _prune(db: sqlite3.Connection, now: float) -> None:
    db.execute(_PRUNE, (now, PRUNE_BATCH))


def _op_put(key: str, value: bytes, ttl: float, db: sqlite3.Connection) -> None:
    now = time.time()
    db.execute(_PUT, (key, value, now + ttl))
    _prune(db, now)


def _op_put_many(items: Sequence[tuple[str, bytes, float]], db: sqlite3.Connection) -> None:
    now = time.time()
    db.executemany(_PUT, [(key, value, now + ttl) for key, value, ttl in items])
    _prune(db, now)


def _op_remove(keys: Sequence[str], db: sqlite3.Connection) -> None:
    db.executemany(_REMOVE, [(key,) for key in keys])
    _prune(db, time.time())


def _op_entries(prefix: str, db: sqlite3.Connection) -> list[KeyEntry]:
    now = time.time()
    bound = prefix_upper_bound(prefix)
    if bound is None:
        rows = db.execute(_ENTRIES_FROM, (prefix, now)).fetchall()
    else:
        rows = db.execute(_ENTRIES_RANGE, (prefix, bound, now)).fetchall()
    return [KeyEntry(key, bytes(value)) for key, value in rows if key.startswith(prefix)]


class SqliteKeyStore:
    """A :class:`~durable_trio.keys.KeyStore` in a SQLite file; expiry on ``time.time()``.

    Create one with :meth:`open` (its own connection thread) or :meth:`attach` (sharing a
    broker's). Both create the ``dt_keys`` table if missing.

    Attributes:
        path: the database file.
    """

    def __init__(self, connection: ConnectionThread) -> None:
        """Wrap a connection thread this store holds one use of. Use :meth:`open` or
        :meth:`attach` instead."""
        self._db = connection
        self.path = connection.path
        self._closed = False

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        synchronous: Synchronous = "NORMAL",
    ) -> SqliteKeyStore:
        """Open (creating if missing) the file and the key table on a connection of its own.

        Args:
            path: the database file (its directory must exist).
            busy_timeout: seconds to wait for another connection's write lock.
            synchronous: ``NORMAL`` or ``FULL``, as for
                :meth:`~durable_trio.brokers.sqlite.SqliteBroker.open`.

        Raises:
            ConfigError: an invalid option.
            BrokerUnavailable: the file cannot be opened or stays locked.
            BrokerError: any other SQLite error.
        """
        connection = await open_connection(path, busy_timeout=busy_timeout, synchronous=synchronous)
        return await cls._on(connection)

    @classmethod
    async def attach(cls, broker: SqliteBroker) -> SqliteKeyStore:
        """A key store sharing ``broker``'s connection thread (and so its file).

        The connection stays open until both the broker and the store are closed.

        Raises:
            BrokerUnavailable: the broker is already closed.
            BrokerError: the key table could not be created.
        """
        if broker.closed:
            raise BrokerUnavailable(f"the SQLite broker on {broker.path!r} is closed")
        connection = broker.connection
        connection.acquire()
        return await cls._on(connection)

    @classmethod
    async def _on(cls, connection: ConnectionThread) -> SqliteKeyStore:
        store = cls(connection)
        try:
            if connection.read_only is None:  # (read-only: the file is read as it is)
                await connection.call(_create_schema, write=True)
        except BaseException:
            await store.aclose()
            raise
        return store

    async def _call_write(self, fn: partial[None]) -> None:
        if self._closed:
            raise BrokerUnavailable(f"the SQLite key store on {self.path!r} is closed")
        await self._db.call(fn, write=True)

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds (from now) unless written again."""
        await self._call_write(partial(_op_put, key, value, ttl))

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Write every ``(key, value, ttl)`` in one transaction."""
        await self._call_write(partial(_op_put_many, tuple(items)))

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        await self._call_write(partial(_op_remove, tuple(keys)))

    async def entries(self, prefix: str) -> list[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key (an index range scan)."""
        if self._closed:
            raise BrokerUnavailable(f"the SQLite key store on {self.path!r} is closed")
        found: list[KeyEntry] = await self._db.call(partial(_op_entries, prefix), write=False)
        return found

    async def aclose(self) -> None:
        """Release the store's use of the connection. Idempotent."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        await self._db.release()

    async def __aenter__(self) -> SqliteKeyStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
