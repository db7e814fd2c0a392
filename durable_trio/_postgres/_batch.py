"""Concurrent writes coalesced into one round trip, each still its own transaction (issue 32).

A write is a few statements that form one transaction (one implicit transaction of a pipeline,
as :meth:`PgPool.pipeline` runs them). Under load, hundreds of tasks each make small writes
and the client spends its time on round trips (a request, a wait, a wake per write).
:class:`WriteBatcher` sends the writes queued at the moment a connection is taken in ONE
pipeline, a sync after each write (:meth:`PgConnection.pipeline_each`): each write commits or
fails on its own, and each caller gets its own results or its own error.

Nagle's rule without the delay: at most ``senders`` tasks send at once (one connection each);
a write made while fewer are sending is sent at once, by its own task (a lone write waits for
nothing); one made while all are busy waits in the queue, and when a sender is done, the
first waiting task becomes a sender and takes everything queued by then (up to ``most``).

Cancellation:
    A write cancelled while it waits in the queue is dropped: nothing was sent. Once taken
    into a pipeline it runs to its end (shielded, bounded), and the cancellation is delivered
    after it, as for a single change. A sender cancelled while it waits for a connection
    takes nothing: its own write is dropped, the queue goes to the next task.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import trio

from .._errors import BrokerUnavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._connection import PgConnection, Result
    from ._pool import PgPool

__all__ = ["WriteBatcher"]

_QUEUED: Final = 0
_TAKEN: Final = 1
_DONE: Final = 2


class _Write:
    __slots__ = ("answer", "handed", "parked", "state", "statements", "task")

    def __init__(self, statements: Sequence[tuple[str | bytes, Sequence[Any]]]) -> None:
        self.statements = statements
        self.state = _QUEUED
        self.answer: list[Result] | BaseException | None = None
        self.task = trio.lowlevel.current_task()
        self.parked = False  # waiting in wait_task_rescheduled
        self.handed = False  # woken to become a sender (a reserved sender slot)


class WriteBatcher:
    """Coalesces the writes of many tasks on ``pool`` (see the module docs).

    Args:
        pool: the pool (the caller's).
        senders: the most tasks sending at once (``None``: the pool's size).
        most: the most writes in one pipeline.
        bound: seconds a write may wait for a connection, and seconds a pipeline may take,
            before its writes fail with ``BrokerUnavailable``.
    """

    def __init__(
        self, pool: PgPool, *, senders: int | None = None, most: int = 64, bound: float = 60.0
    ) -> None:
        self._pool = pool
        self._limit = pool.size if senders is None else senders
        self._most = most
        self._bound = bound
        self._queue: deque[_Write] = deque()
        self._senders = 0

    async def write(self, statements: Sequence[tuple[str | bytes, Sequence[Any]]]) -> list[Result]:
        """Run ``statements`` as one transaction, in a pipeline with whatever else is queued.

        Returns:
            one :class:`Result` per statement.

        Raises:
            PostgresError: a statement failed (nothing of this write was committed).
            PostgresCommandTimeout: the pipeline timed out (this write may have run).
            BrokerUnavailable: no connection within the bound, the pipeline did not finish
                within it, or the connection went down (it may have run).
            TransportClosed: the pool is closed.
            ValueError: a parameter psycopg cannot adapt (nothing of it was sent).

        Cancellation:
            See the module docs.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        write = _Write(statements)
        self._queue.append(write)
        deadline = trio.current_time() + self._bound
        sender = self._senders < self._limit
        if sender:
            self._senders += 1
        while write.state != _DONE:
            if write.handed:
                write.handed = False
                if sender:  # (cannot happen: a sender is not parked) give one back
                    self._release()
                sender = True
            if sender:
                sender = False
                if write.state == _QUEUED:
                    await self._send(write, deadline)
                else:  # taken by another sender meanwhile
                    self._release()
                continue
            await self._park(write)
        answer = write.answer
        if isinstance(answer, BaseException):
            raise answer
        assert answer is not None
        await trio.lowlevel.checkpoint_if_cancelled()
        return answer

    # -- internals ------------------------------------------------------------------------

    async def _park(self, write: _Write) -> None:
        def abort(_: Any) -> trio.lowlevel.Abort:
            if write.state != _QUEUED:
                return trio.lowlevel.Abort.FAILED  # taken: runs to its end, woken then
            write.parked = False
            self._queue.remove(write)
            if write.handed:
                write.handed = False
                self._release()
            return trio.lowlevel.Abort.SUCCEEDED

        write.parked = True
        await trio.lowlevel.wait_task_rescheduled(abort)

    @staticmethod
    def _wake(write: _Write) -> None:
        if write.parked:
            write.parked = False
            trio.lowlevel.reschedule(write.task)

    def _release(self) -> None:
        """A sender slot comes back: the first parked write still queued takes it."""
        self._senders -= 1
        for write in self._queue:
            if self._senders >= self._limit:
                return
            if write.parked and not write.handed and write.state == _QUEUED:
                write.handed = True
                self._senders += 1
                self._wake(write)
                return

    def _take(self) -> list[_Write]:
        batch: list[_Write] = []
        queue = self._queue
        while queue and len(batch) < self._most:
            write = queue.popleft()
            write.state = _TAKEN
            batch.append(write)
        return batch

    async def _send(self, own: _Write, deadline: float) -> None:
        """(Holding a sender slot, ``own`` queued.) Take a connection, then the queue, and
        send it; a failure before anything was taken drops ``own`` and is raised."""
        pool = self._pool
        taken = False
        try:
            conn: PgConnection | None = None
            if trio.current_time() < deadline:
                # An idle connection is taken without a cancel scope for the bound (only a
                # wait for one needs it): one scope less per pipeline.
                await trio.lowlevel.checkpoint_if_cancelled()
                conn = pool._take_idle()
            if conn is None:
                with trio.move_on_at(deadline):
                    conn = await pool._acquire()
            if conn is not None:
                try:
                    taken = True
                    await self._run(conn)
                finally:
                    await pool._give_back(conn)
            if not taken and own.state == _QUEUED:
                raise BrokerUnavailable(
                    f"no PostgreSQL connection for a write within {self._bound:g} s"
                )
        except BaseException as exc:
            if own.state == _QUEUED:
                self._queue.remove(own)
                raise
            if not isinstance(exc, (Exception, trio.Cancelled)):
                raise
            # Its write was taken (by another sender, or this one): its answer stands; a
            # cancellation is delivered again after it.
        finally:
            self._release()

    async def _run(self, conn: PgConnection) -> None:
        """Take the queue and send it on ``conn``, shielded and bounded; every write taken gets
        its answer and is woken."""
        batch = self._take()
        done = False
        try:
            with trio.move_on_after(self._bound, shield=True):
                answers = await conn.pipeline_each([w.statements for w in batch])
                done = True
        except Exception as exc:
            for write in batch:
                write.answer = copy.copy(exc)
        else:
            if done:
                for write, answer in zip(batch, answers, strict=True):
                    write.answer = answer
        finally:
            for write in batch:
                if write.answer is None:
                    write.answer = BrokerUnavailable(
                        f"PostgreSQL did not finish a write within {self._bound:g} s"
                    )
                write.state = _DONE
                self._wake(write)
