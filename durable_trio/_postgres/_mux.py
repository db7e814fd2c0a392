"""Several pipelines in flight on one connection, answered in order (the PostgreSQL broker's
finish-and-claim calls).

A pooled call sends its statements and waits for their answers with the connection to itself:
while the server runs one call, the next waits for the answer to go out on another connection,
and the server's backend sleeps between the two. :class:`PgMux` keeps one pooled connection in
libpq's pipeline mode for a whole stream of calls: each call queues its statements and a sync
(one implicit transaction each, as :meth:`PgConnection.pipeline`), flushes them and waits; one
reader task reads the answers, sync by sync, and hands each to its call, first in first out.
The server runs the next call's transaction the moment the last one commits, while this process
works on the last one's answer: a worker that finalizes its jobs in two halves keeps both its
own process and the server busy (docs/decisions.md, "PostgreSQL finalizes in two halves on one
pipelined connection").

Failure:
    A call whose statement fails gets its :class:`PostgresError` (nothing of it committed);
    the calls after it are not touched (each sync is its own transaction). Anything else (the
    connection lost, a send that fails, a call cancelled before its answer came: its deadline)
    gives the connection up: it is closed, every call still waiting gets
    :class:`~durable_trio.BrokerUnavailable` (it may have run, as after a lost reply on any
    connection), and the next call opens another. Cancelling a waiting call therefore costs
    the others theirs: the broker's calls are shielded, only their deadline cancels them.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import psycopg
import trio
from psycopg import generators

from .._errors import BrokerUnavailable, TransportClosed
from ._connection import _sql, one_sync
from ._errors import PostgresError, unavailable
from ._wait import drive

if TYPE_CHECKING:
    from collections.abc import Sequence

    from psycopg.pq.abc import PGresult

    from ._connection import PgConnection, Result
    from ._pool import PgPool

__all__ = ["PgMux"]


class _Call:
    __slots__ = ("answered", "error", "results")

    def __init__(self) -> None:
        self.answered = trio.Event()
        self.results: list[PGresult] = []
        self.error: BaseException | None = None


class _Live:
    """One connection in pipeline mode, its calls waiting in order, and the reason it was
    given up (``None`` while it serves)."""

    def __init__(self, conn: PgConnection) -> None:
        self.conn = conn
        self.waiting: collections.deque[_Call] = collections.deque()
        self.error: BaseException | None = None
        self.wake = trio.Event()
        self.writing = trio.Lock()

    def lost(self, exc: BaseException) -> BrokerUnavailable:
        """What a call on this connection raises once ``exc`` ended it."""
        return unavailable(
            f"lost the connection to PostgreSQL at {self.conn.address}: {exc!r} "
            "(the call may have run)"
        )

    def give_up(self, exc: BaseException) -> None:
        """Close the connection (a task waiting on it wakes) and fail every call waiting."""
        if self.error is not None:
            return
        self.error = exc
        self.conn.close()
        for call in self.waiting:
            call.error = self.lost(exc)
            call.answered.set()
        self.waiting.clear()
        self.wake.set()

    async def submit(self, statements: Sequence[tuple[str | bytes, Sequence[Any]]]) -> list[Result]:
        if self.error is not None:
            raise unavailable(f"the pipelined PostgreSQL connection was given up: {self.error!r}")
        conn = self.conn
        # ValueError (a parameter psycopg cannot adapt) before anything is queued: nothing sent.
        sends = [conn._prepare(_sql(query), params) for query, params in statements]
        pgconn = conn._pgconn
        call = _Call()
        try:
            for send in sends:
                send.call()
            pgconn.pipeline_sync()
        except psycopg.Error as exc:
            self.give_up(exc)
            raise self.lost(exc) from exc
        self.waiting.append(call)
        self.wake.set()
        try:
            async with self.writing:
                await drive(generators.send(pgconn), conn._fd)
            await call.answered.wait()
        except BaseException as exc:
            if not call.answered.is_set():
                self.give_up(exc)  # sent in part, or its answer never read: nobody can tell
            if isinstance(exc, (psycopg.Error, OSError, trio.ClosedResourceError)):
                raise self.lost(exc) from exc
            raise
        if call.error is not None:
            raise call.error
        answer = conn._group(sends, call.results)
        if isinstance(answer, PostgresError):
            raise answer
        return answer

    async def read(self) -> None:
        """Hand each call its results, in order, until the connection is given up."""
        conn = self.conn
        try:
            while self.error is None:
                if not self.waiting:
                    self.wake = trio.Event()
                    await self.wake.wait()
                    continue
                results = await drive(one_sync(conn._pgconn), conn._fd)
                if self.error is not None:
                    return
                call = self.waiting.popleft()
                call.results = results
                call.answered.set()
        except BaseException as exc:
            # Whatever ended the reading (a lost connection, or a defect here), the calls
            # waiting fail and the next call opens another connection: only a cancellation
            # (the broker closing) goes on up, never an error that would end the broker.
            self.give_up(exc)
            if not isinstance(exc, Exception):
                raise


class PgMux:
    """Calls pipelined on one connection of ``pool``, its reader task in ``nursery`` (see the
    module docs). The connection is taken from the pool at the first call (and again after it
    was given up) and held until :meth:`close`, one of the pool's ``size``."""

    def __init__(self, pool: PgPool, nursery: trio.Nursery) -> None:
        self._pool = pool
        self._nursery = nursery
        self._live: _Live | None = None
        self._opening = trio.Lock()
        self._closed = False

    async def pipeline(
        self, statements: Sequence[tuple[str | bytes, Sequence[Any]]]
    ) -> list[Result]:
        """Run ``statements`` as one implicit transaction (as :meth:`PgPool.pipeline`).

        Raises:
            PostgresError: a statement failed; nothing of the call was committed.
            BrokerUnavailable: the connection could not be had, or was lost (the call may
                have run).
            TransportClosed: :meth:`close` was called.
            ValueError: a parameter psycopg cannot adapt (nothing was sent).
        """
        live = self._live
        if live is None or live.error is not None:
            async with self._opening:
                live = self._live
                if live is None or live.error is not None:
                    if self._closed:
                        raise TransportClosed("the pipelined PostgreSQL connection is closed")
                    live = self._live = await self._nursery.start(self._serve)
        return await live.submit(statements)

    async def _serve(self, task_status: trio.TaskStatus[_Live]) -> None:
        async with self._pool.connection() as conn:
            live = _Live(conn)
            try:
                conn._pgconn.enter_pipeline_mode()
            except psycopg.Error as exc:
                conn.close()
                raise unavailable(f"could not enter pipeline mode: {exc}") from exc
            task_status.started(live)
            try:
                await live.read()
            finally:
                # Closed whatever ended the reading: the pool drops it when it comes back.
                live.give_up(TransportClosed("the pipelined connection was closed"))

    def close(self) -> None:
        """Give the connection up (calls waiting get ``BrokerUnavailable``); later calls raise
        ``TransportClosed``."""
        self._closed = True
        if self._live is not None:
            self._live.give_up(TransportClosed("the PostgreSQL broker is closing"))
