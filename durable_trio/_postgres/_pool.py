"""A small fixed-size pool of PostgreSQL connections for Trio.

At most ``size`` connections exist; a caller holds one for one call (:meth:`PgPool.execute`
and friends) or one block (:meth:`PgPool.connection`, :meth:`PgPool.transaction`), and waits for
a free slot when all are taken. Connections are opened when first needed and replaced when they
die; the pool runs no background task.

A connection is given back to the pool only in a known state: idle, outside any transaction.
One that comes back mid-transaction is rolled back (shielded, bounded); one whose statement was
interrupted was already made safe or closed by the connection itself (see ``_connection.py``);
one that was closed is dropped, and its slot frees. An idle connection is checked without
waiting before it is handed out again (:meth:`PgConnection.check_idle`): one the server closed
meanwhile (a restart, ``pg_terminate_backend``) is replaced rather than failing the caller.
Every connection opened sets :attr:`PgPool.connected` (what a reconnection looks like from
outside: the broker checks the store's identity then).

Cancellation:
    Waiting for a slot, or for a connection being opened, is cancelled with nothing left
    behind. A statement cancelled after it was sent follows the connection's rule (made safe
    or closed; it may or may not have run). Giving a connection back is shielded and bounded.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio
from trio_util import RepeatedEvent

from .._arguments import check_backoff_range, check_positive
from .._backoff import Backoff
from .._errors import BrokerUnavailable, ConfigError, TransportClosed
from ._connection import ConnectionStats, PgConnection, Result, connect, parse_conninfo
from ._errors import PostgresAuthError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from types import TracebackType

__all__ = ["PgPool", "PoolStats", "open_pool"]


@attrs.define
class PoolStats:
    """Counters of a pool (for tests, benchmarks and debugging).

    Attributes:
        connects: connections opened.
        failed_connects: attempts to open one that failed.
        discarded: connections dropped because they were found dead or came back unusable.
    """

    connects: int = 0
    failed_connects: int = 0
    discarded: int = 0


def open_pool(
    conninfo: str,
    *,
    size: int = 8,
    connect_timeout: float = 10.0,
    command_timeout: float = 30.0,
    recover_timeout: float = 5.0,
    backoff_initial: float = 0.05,
    backoff_max: float = 2.0,
    prepare_statements: bool = True,
) -> PgPool:
    """Make a pool for ``conninfo``; use it as ``async with open_pool(url) as pool:``.

    Args:
        conninfo: a ``postgresql://`` URL or a ``key=value`` string (libpq's).
        size: the most connections open at once.
        connect_timeout: seconds to open one connection.
        command_timeout: default seconds a statement may take before the driver cancels it.
        recover_timeout: seconds to make a connection safe after an interrupted statement, or
            to roll back a transaction left open, before it is closed instead.
        backoff_initial: after a failed connect, seconds during which new connects are not
            tried (calls fail fast with ``BrokerUnavailable``); doubled per consecutive
            failure, jittered down to half, capped at ``backoff_max``.
        backoff_max: the cap of that delay.
        prepare_statements: each connection prepares its statements on the server (see
            :func:`~._connection.connect`).

    Returns:
        the (not yet entered) pool.

    Raises:
        ConfigError: a bad URL or option.
    """
    parse_conninfo(conninfo)
    if size < 1:
        raise ConfigError(f"size must be at least 1, not {size}")
    check_positive(
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        recover_timeout=recover_timeout,
        backoff_max=backoff_max,
    )
    check_backoff_range(backoff_initial, backoff_max)
    return PgPool(
        conninfo,
        size=size,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        recover_timeout=recover_timeout,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
        prepare_statements=prepare_statements,
    )


class PgPool:
    """A pool of PostgreSQL connections (made by :func:`open_pool`); an async context manager.

    Leaving the ``async with`` (or :meth:`close`) closes the idle connections at once and each
    connection in use when it comes back; later calls raise
    :class:`~durable_trio._errors.TransportClosed`.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        size: int,
        connect_timeout: float,
        command_timeout: float,
        recover_timeout: float,
        backoff_initial: float,
        backoff_max: float,
        prepare_statements: bool = True,
    ) -> None:
        self._conninfo = conninfo
        self._prepare_statements = prepare_statements
        self._size = size
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._recover_timeout = recover_timeout
        # jittered down to half, so pools that failed together do not reconnect in lockstep
        self._backoff = Backoff(backoff_initial, backoff_max, jitter=0.5)
        self._slots = trio.Semaphore(size)
        # Most recently returned last: the warmest connection is handed out first.
        self._idle: deque[PgConnection] = deque()
        self._failures = 0
        self._retry_at = 0.0
        self._last_error: BrokerUnavailable | PostgresAuthError | None = None
        self._closed = False
        self.stats = PoolStats()
        self.connection_stats = ConnectionStats()
        """The counters of all its connections, summed (statements, interrupted, ...)."""
        self.connected = RepeatedEvent()
        """Set each time the pool opens a connection (the first ones, and every one replacing
        a connection lost: after a server restart, a reconnection)."""

    async def __aenter__(self) -> PgPool:
        if self._closed:
            raise RuntimeError("a closed PgPool cannot be entered again")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the pool now, from any task; idempotent (see the class docs)."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    @property
    def size(self) -> int:
        """The most connections open at once."""
        return self._size

    @property
    def idle_connections(self) -> tuple[PgConnection, ...]:
        """The connections waiting in the pool (for tests and debugging)."""
        return tuple(self._idle)

    # -- calls --------------------------------------------------------------------------------

    async def execute(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> Result:
        """Run one statement on a pooled connection (see :meth:`PgConnection.execute`).

        Raises:
            PostgresError: the server reported an error for the statement.
            PostgresCommandTimeout: no answer within ``command_timeout``.
            BrokerUnavailable: the server cannot be reached (also while backing off after a
                failed connect).
            PostgresAuthError: the credentials were refused.
            TransportClosed: the pool is closed.

        Cancellation:
            As :meth:`PgConnection.execute`; waiting for a free connection is cancelled with
            nothing done.
        """
        conn = await self._acquire()
        try:
            return await conn.execute(query, *params, command_timeout=command_timeout)
        finally:
            await self._give_back(conn)

    async def fetch(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement and return its rows (see :meth:`execute`)."""
        return (await self.execute(query, *params, command_timeout=command_timeout)).rows

    async def fetchrow(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> tuple[Any, ...] | None:
        """Run one statement and return its first row, or ``None`` (see :meth:`execute`)."""
        rows = (await self.execute(query, *params, command_timeout=command_timeout)).rows
        return rows[0] if rows else None

    async def fetchval(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> Any:
        """Run one statement and return the first column of its first row, or ``None``."""
        rows = (await self.execute(query, *params, command_timeout=command_timeout)).rows
        return rows[0][0] if rows else None

    async def script(self, sql: str, *, command_timeout: float | None = None) -> None:
        """Run several statements without parameters (see :meth:`PgConnection.script`)."""
        conn = await self._acquire()
        try:
            await conn.script(sql, command_timeout=command_timeout)
        finally:
            await self._give_back(conn)

    async def pipeline(
        self,
        statements: Sequence[tuple[str | bytes, Sequence[Any]]],
        *,
        command_timeout: float | None = None,
    ) -> list[Result]:
        """Run several statements in one round trip on one pooled connection, as one implicit
        transaction (see :meth:`PgConnection.pipeline`)."""
        conn = await self._acquire()
        try:
            return await conn.pipeline(statements, command_timeout=command_timeout)
        finally:
            await self._give_back(conn)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[PgConnection]:
        """Hold one connection for the block (several statements on one session).

        Yields:
            the connection (idle, autocommit).

        Raises:
            BrokerUnavailable: none could be opened.
            PostgresAuthError: the credentials were refused.
            TransportClosed: the pool is closed.

        Cancellation:
            Giving the connection back is shielded and bounded: a transaction the block left
            open is rolled back, or the connection closed.
        """
        conn = await self._acquire()
        try:
            yield conn
        finally:
            await self._give_back(conn)

    @asynccontextmanager
    async def transaction(
        self, *, isolation: str | None = None, read_only: bool = False
    ) -> AsyncIterator[PgConnection]:
        """Hold one connection for the block and run it in a transaction (see
        :meth:`PgConnection.transaction`).

        Yields:
            the connection, inside ``BEGIN``.
        """
        async with (
            self.connection() as conn,
            conn.transaction(isolation=isolation, read_only=read_only),
        ):
            yield conn

    # -- slots and connections ----------------------------------------------------------------

    def _take_idle(self) -> PgConnection | None:
        """An idle connection (checked) and its slot, taken without waiting or a checkpoint;
        ``None``, with nothing taken, if no slot is free or no idle connection is good."""
        if self._closed or not self._idle:
            return None
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            return None
        conn = self._pop_idle()
        if conn is None:
            self._slots.release()
        return conn

    def _pop_idle(self) -> PgConnection | None:
        """The most recently idle connection that is still good (the bad ones before it
        closed and counted as discarded); ``None`` when none is."""
        while self._idle:
            conn = self._idle.pop()
            if conn.check_idle():
                return conn
            conn.close()
            self.stats.discarded += 1
        return None

    async def _acquire(self) -> PgConnection:
        if self._closed:
            raise TransportClosed("the PostgreSQL pool is closed")
        try:
            # A free slot is taken without a trip through the scheduler: the statement that
            # follows waits for its answer (a checkpoint) anyway. A free slot means nobody
            # waits for one (a release hands it straight to the first waiter): still FIFO.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            if self._closed:
                raise TransportClosed("the PostgreSQL pool is closed")
            conn = self._pop_idle()
            return conn if conn is not None else await self._connect()
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self) -> PgConnection:
        if self._failures and trio.current_time() < self._retry_at:
            await trio.lowlevel.checkpoint()
            last = self._last_error
            if isinstance(last, PostgresAuthError):
                # Refused credentials stay an authentication error while backing off.
                raise PostgresAuthError(str(last), sqlstate=last.sqlstate)
            wait = self._retry_at - trio.current_time()
            raise BrokerUnavailable(f"{last}; next connect attempt in {wait:.2f}s")
        try:
            conn = await connect(
                self._conninfo,
                connect_timeout=self._connect_timeout,
                command_timeout=self._command_timeout,
                recover_timeout=self._recover_timeout,
                stats=self.connection_stats,
                prepare_statements=self._prepare_statements,
            )
        except (BrokerUnavailable, PostgresAuthError) as exc:
            self.stats.failed_connects += 1
            self._failures += 1
            self._retry_at = trio.current_time() + self._backoff.delay(self._failures)
            self._last_error = exc
            raise
        self._failures = 0
        self._last_error = None
        self.stats.connects += 1
        self.connected.set()
        return conn

    async def _give_back(self, conn: PgConnection) -> None:
        """Return ``conn`` and its slot: idle into the pool, otherwise rolled back (shielded,
        bounded) or closed."""
        try:
            if not conn.closed and not conn.idle:
                await conn.rollback_quietly()
        finally:
            if self._closed or not conn.idle:
                if not conn.closed:
                    conn.close()
                if not self._closed:
                    self.stats.discarded += 1
            else:
                self._idle.append(conn)
            self._slots.release()
