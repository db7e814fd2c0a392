"""The SQLite broker: :class:`SqliteBroker`, which composes the parts of this package.

It holds a connection thread (:mod:`durable_trio._sqlite`, shared with a key store or a run
store on the same file), creates its tables on open (``_schema.py``), runs each call as one of
``_operations.py``'s functions in that thread, and owns a :class:`~._wakeup.WakeUps`
(``_wakeup.py``) that wakes its waiters: at once for its own pushes, by the doorbell for other
processes', by the connection thread's tick for the rest. The package docstring
(:mod:`durable_trio.brokers.sqlite`) describes the whole.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import attrs
import trio

from ..._errors import BrokerError, BrokerUnavailable, ConfigError
from ..._sqlite import ConnectionThread, ReadOnly, Synchronous, open_connection
from .._contract import RateGrant, RenewOutcome
from .._limits import check_limit
from .._rates import check_rate, log_name
from . import _operations as ops
from . import _rates as rates
from ._schema import create_schema
from ._wakeup import Waiter, WakeUps

if TYPE_CHECKING:
    import os
    import sqlite3
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from .._contract import (
        ClaimedJob,
        FailedJob,
        Job,
        JobState,
        Lease,
        QuarantinedEntry,
        QueueStats,
        Recovery,
    )

__all__ = ["WAKEUP_INTERVAL", "SqliteBroker"]

T = TypeVar("T")

#: The default safety-net tick (seconds): the doorbell wakes waiters across processes, the
#: tick only catches what it misses.
WAKEUP_INTERVAL: Final = 0.5


def _always(result: object) -> bool:
    """Ring after every commit of the operation (any push can make work ready)."""
    return True


class SqliteBroker:
    """A :class:`~durable_trio.brokers.QueueBroker` on one SQLite file, with every capability.

    One file may host many queues (and the key store, :class:`~durable_trio.keys.sqlite.
    SqliteKeyStore`); many brokers in many processes may share it. Create one with
    :meth:`open`, which creates the schema if missing.

    Ready jobs pop in (priority, sequence) order, the sequence being one counter per file, so
    FIFO within one priority holds across processes. Each pop promotes at most
    :data:`PROMOTE_BATCH` due delayed jobs first. Failed jobs are kept (newest
    ``failed_retention`` per queue) for :meth:`failed_jobs`; rows whose id could not be read,
    all of them, for :meth:`quarantined`.

    Attributes:
        path: the database file.
        wakeup_interval: the safety-net tick: seconds between two looks at other connections'
            commits while :meth:`wait_for_work` waits (the doorbell wakes waiters sooner).
        doorbell: the cross-process doorbell (``None``: opened with ``doorbell=False``).
    """

    #: Its finalizes go one call at a time (``SupportsFinishAndClaim``): one connection thread
    #: runs one transaction after another, so a second call in flight overlaps nothing and
    #: smaller batches only pay a transaction's fixed cost more often.
    finalize_in_halves = False

    def __init__(
        self,
        connection: ConnectionThread,
        *,
        wakeup_interval: float = WAKEUP_INTERVAL,
        failed_retention: int = 1000,
        doorbell: bool = True,
    ) -> None:
        """Wrap an open connection thread. Use :meth:`open` instead."""
        if not wakeup_interval > 0:
            raise ConfigError(f"wakeup_interval must be > 0, not {wakeup_interval!r}")
        if failed_retention < 0:
            raise ConfigError(f"failed_retention must be >= 0, not {failed_retention!r}")
        self._db = connection
        self.path = connection.path
        self.wakeup_interval = wakeup_interval
        self._failed_retention = failed_retention
        self._closed = False
        self._wakeups = WakeUps(connection, wakeup_interval, self.path, doorbell=doorbell)
        self.doorbell = self._wakeups.doorbell

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        synchronous: Synchronous = "NORMAL",
        wakeup_interval: float = WAKEUP_INTERVAL,
        failed_retention: int = 1000,
        doorbell: bool = True,
        read_only: ReadOnly = None,
    ) -> SqliteBroker:
        """Open (creating if missing) the database file and its schema.

        Args:
            path: the database file (its directory must exist); a ``file:`` URI is accepted.
            busy_timeout: seconds to wait for another connection's write lock before an
                operation fails with :class:`~durable_trio.BrokerUnavailable`.
            synchronous: ``NORMAL`` (default: in WAL mode safe against any process crash; a
                power loss may lose the last commits, never corrupt the file) or ``FULL``
                (also safe against power loss, one ``fsync`` per commit).
            wakeup_interval: the safety-net tick: seconds between two looks for other
                connections' commits while :meth:`wait_for_work` waits (default 0.5: two cheap
                ``PRAGMA data_version`` reads per second per broker, however many queues wait).
                Pushes by other brokers on this machine ring the doorbell and wake waiters
                within a millisecond or two; the tick catches what the doorbell cannot (no
                doorbell folder, a lost datagram, another program writing the file). Pushes by
                this broker wake its waiters at once.
            failed_retention: failed jobs kept per queue (the newest).
            doorbell: ring and listen to the cross-process doorbell (``<file>.bells/``, see
                the module docstring); ``False``: the tick alone notices other processes.
            read_only: ``"ro"`` or ``"immutable"``: read the file as it is (see
                :class:`~durable_trio._sqlite.ConnectionThread`): no schema is created, no
                doorbell opened, and every call that changes something raises
                :class:`~durable_trio.BrokerError`.

        Returns:
            The open broker; close it with :meth:`aclose` (or ``async with``).

        Raises:
            ConfigError: an invalid option.
            BrokerUnavailable: the file cannot be opened or stays locked.
            BrokerError: any other SQLite error (say, not a database).
        """
        connection = await open_connection(
            path, busy_timeout=busy_timeout, synchronous=synchronous, read_only=read_only
        )
        try:
            broker = cls(
                connection,
                wakeup_interval=wakeup_interval,
                failed_retention=failed_retention,
                doorbell=doorbell and read_only is None,
            )
            if read_only is None:
                await connection.call(create_schema, write=True)
        except BaseException:
            await connection.aclose()
            raise
        return broker

    async def _call(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        write: bool,
        ring: str | None = None,
        ring_if: Callable[[T], object] = _always,
        ready: bool = True,
    ) -> T:
        """Run ``fn`` on the connection; with ``ring``, ring the other brokers' doorbells for
        that queue right after the commit (in the connection thread) if ``ring_if(result)``.
        ``ready=False`` (a delayed job): the ring names no queue, so the receivers look (their
        tick learns the new due time) instead of popping at once for nothing."""
        if self._closed:
            raise BrokerUnavailable(f"the SQLite broker on {self.path!r} is closed")
        doorbell = self.doorbell
        if ring is None or doorbell is None:
            return await self._db.call(fn, write=write)
        queue = ring if ready else None

        def after_commit(result: T) -> None:
            if ring_if(result):
                doorbell.ring(queue)

        return await self._db.call(fn, write=write, after_commit=after_commit)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    @property
    def lost(self) -> str | None:
        """What happened to the file, once it was found deleted or replaced under this
        process (every call then raises :class:`~durable_trio.StoreLost` saying it); ``None``
        while it is the file opened (see :class:`ConnectionThread`, "The file's identity")."""
        return self._db.lost

    @property
    def connection(self) -> ConnectionThread:
        """The connection thread (a key store may share it, see ``SqliteKeyStore.attach``)."""
        return self._db

    async def __aenter__(self) -> SqliteBroker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- required

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        """Enqueue ``job`` (see :class:`~durable_trio.brokers.QueueBroker`)."""
        await self._call(
            partial(ops.push, queue, job, priority or 0, delay),
            write=True,
            ring=queue,
            ready=delay <= 0,
        )
        self._wakeups.ring(queue)

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Promote due delayed jobs (at most :data:`PROMOTE_BATCH`), then claim the next
        ready job under a fresh random lease token, or return ``None``."""
        result: ClaimedJob | None = await self._call(partial(ops.pop, queue, worker), write=True)
        return result

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Like :meth:`pop_from`, claiming up to ``count`` jobs in one transaction, in pop
        order (an empty list: none ready)."""
        if count <= 0:
            await trio.lowlevel.checkpoint()
            return []
        claimed: list[ClaimedJob] = await self._call(
            partial(ops.pop_many, queue, count, worker), write=True
        )
        return claimed

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        """:meth:`pop_many` of ``count + ahead`` jobs, the last ``ahead`` stored as not started
        (see :class:`~durable_trio.brokers.SupportsClaimAhead`)."""
        if count + ahead <= 0:
            await trio.lowlevel.checkpoint()
            return []
        claimed: list[ClaimedJob] = await self._call(
            partial(ops.pop_many, queue, count, worker, ahead=ahead), write=True
        )
        return claimed

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark claims popped ahead started, and renew them (one transaction)."""
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        marked: list[bool] = await self._call(
            partial(ops.mark_started, queue, tuple(leases)), write=True
        )
        return marked

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Delete a finished job. ``False``: the lease was lost, nothing changed."""
        done: bool = await self._call(partial(ops.complete, lease, queue), write=True)
        self._wakeups.ring_freed(queue)
        return done

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in one transaction."""
        done: list[bool] = await self._call(partial(ops.complete_many, leases, queue), write=True)
        self._wakeups.ring_freed(queue)
        return done

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job, in one transaction."""
        pairs = list(zip(jobs, priorities, strict=True))
        await self._call(partial(ops.push_many, queue, pairs), write=True, ring=queue)
        self._wakeups.ring(queue)

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        """Push then complete, in one transaction (:meth:`finish_and_claim` claiming none)."""
        done, _ = await self.finish_and_claim(push_queue, jobs, queue, leases, 0)
        return done

    async def finish_and_claim(
        self,
        push_queue: str,
        jobs: Sequence[Job],
        queue: str,
        leases: Sequence[Lease],
        count: int,
        *,
        worker: str = "",
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """Push, complete, then claim up to ``count`` jobs of ``queue``, in one transaction
        (see :class:`~durable_trio.brokers.SupportsFinishAndClaim`)."""
        pairs: list[tuple[Job, int | None]] = [(job, None) for job in jobs]

        def all_three(db: sqlite3.Connection) -> tuple[list[bool], list[ClaimedJob]]:
            ops.push_many(push_queue, pairs, db)
            done = ops.complete_many(leases, queue, db)
            return done, ops.pop_many(queue, count, worker, db) if count > 0 else []

        # Nothing pushed (a consumer acknowledging and claiming only): no ring. Every other
        # process's doorbell would wake for it, and a wake-up for nothing opens the gap the
        # next real ring then waits out (issue 30, item 8).
        answer: tuple[list[bool], list[ClaimedJob]] = await self._call(
            all_three, write=True, ring=push_queue if jobs else None
        )
        if jobs:
            self._wakeups.ring(push_queue)
        self._wakeups.ring_freed(queue)
        return answer

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good, kept for :meth:`failed_jobs`. ``False``: the lease was lost."""
        done: bool = await self._call(
            partial(ops.fail, lease, queue, error, self._failed_retention), write=True
        )
        self._wakeups.ring_freed(queue)
        return done

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """:meth:`fail_job`, then (if the lease held) push ``job`` onto ``push_queue``, in one
        transaction. ``False``: the lease was lost, nothing changed."""
        done: bool = await self._call(
            partial(ops.fail_and_push, lease, queue, error, self._failed_retention, push_queue,
                    job),
            write=True,
            ring=push_queue,
            ring_if=bool,
        )
        if done:
            self._wakeups.ring(push_queue)
            self._wakeups.ring_freed(queue)
        return done

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds, at the back of its
        priority. ``count_attempt=False`` leaves ``attempts`` alone. ``False``: lease lost."""
        done: bool = await self._call(
            partial(ops.retry, lease, queue, delay, count_attempt),
            write=True,
            ring=queue,
            ring_if=bool,
            ready=delay <= 0,
        )
        if done:
            self._wakeups.ring(queue)
        return done

    async def aclose(self) -> None:
        """Close the broker (and its connection, unless a key store still shares it).
        Idempotent. Later calls raise :class:`~durable_trio.BrokerUnavailable`."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self.doorbell is not None:
            self.doorbell.close()
        await self._db.release()

    # -- capabilities

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        """Refresh ``claimed_at`` of every claim in ``leases`` still held (one transaction)."""
        if not leases:
            await trio.lowlevel.checkpoint()
            return RenewOutcome(renewed=0)
        result: RenewOutcome = await self._call(
            partial(ops.renew, queue, tuple(leases)), write=True
        )
        return result

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        """Take back claims older than ``threshold`` seconds: an index range on
        (queue, claimed_at), so O(log n + k). Each gets a stall ``{at, worker}`` appended
        (``"counted": false`` for a claim popped ahead and never started, whose count stays as
        it was); past ``max_stalled`` it is re-leased to the caller (still active) and returned in
        ``exceeded``, otherwise put back to ready."""
        result: Recovery = await self._call(
            partial(ops.recover, queue, threshold, max_stalled),
            write=True,
            ring=queue,
            ring_if=lambda recovery: recovery.recovered,
        )
        if result.recovered:
            self._wakeups.ring(queue)
        return result

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s fleet-wide limit in the file, for every process (see
        :class:`~durable_trio.brokers.SupportsQueueLimits`): each claim then counts the
        queue's (or its key's) active rows in its own write transaction, which SQLite runs
        one at a time, so the limit is exact however many processes claim."""
        limit = check_limit(limit)
        await self._call(
            partial(ops.set_limit, queue, limit, per_key), write=True, ring=queue
        )
        self._wakeups.ring(queue)
    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s rate limit in the file, for every process (see
        :class:`~durable_trio.brokers.SupportsRateLimits`)."""
        if count is not None:
            count, per = check_rate(count, per)
        await self._call(partial(rates.set_rate, queue, count, per, per_key), write=True)

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        """Log up to ``want`` starts of ``queue`` (of its ``key``) that fit its rate (one
        write transaction)."""
        granted, retry_after, at = await self._call(
            partial(rates.take, queue, want, key=key), write=True
        )
        return RateGrant(granted, retry_after, at)

    async def return_starts(
        self, queue: str, at: float, n: int, key: str | None = None
    ) -> None:
        """Remove ``n`` starts of ``queue`` (of its ``key``) logged at ``at``."""
        await self._call(partial(rates.give_back, log_name(queue, key), at, n), write=True)


    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        size: int = await self._call(partial(ops.size, queue), write=False)
        return size

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs (see
        :class:`~durable_trio.brokers.SupportsQueueListing`)."""
        queues: list[str] = await self._call(partial(ops.waiting_queues, prefix), write=False)
        return queues

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed (see
        :class:`~durable_trio.brokers.SupportsJobState`)."""
        state: JobState | None = await self._call(
            partial(ops.job_state, queue, job_id), write=False
        )
        return state

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``, in one read (see
        :class:`~durable_trio.brokers.SupportsJobStates`)."""
        states: list[JobState | None] = await self._call(
            partial(ops.job_states, queue, list(job_ids)), write=False
        )
        return states

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        limit = min(limit, self._failed_retention)
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        jobs: list[FailedJob] = await self._call(
            partial(ops.failed_jobs, queue, limit), write=False
        )
        return jobs

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, its counters reset (see
        :class:`~durable_trio.brokers.SupportsFailedJobRepair`; its stored priority unless
        ``priority`` is given)."""
        done: bool = await self._call(
            partial(ops.requeue_failed, queue, job_id, priority),
            write=True,
            ring=queue,
            ring_if=bool,
        )
        if done:
            self._wakeups.ring(queue)
        return done

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        done: bool = await self._call(partial(ops.delete_failed, queue, job_id), write=True)
        return done

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts and its oldest ready job's age, in one statement (one pass over
        the queue's ready rows for their ``pushed_at``). The age is ``None`` while a ready row
        has none that can be read: NULL (pushed before the column was added to an older
        file), TEXT, BLOB or infinite (damaged)."""

        def read(db: sqlite3.Connection) -> QueueStats:
            rated = rates.window(queue, db)
            return attrs.evolve(ops.queue_stats(queue, db), **rated)

        stats: QueueStats = await self._call(read, write=False)
        return stats

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed, failed)."""
        names: list[str] = await self._call(partial(ops.known_queues, prefix), write=False)
        return names

    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The rows of ``queue`` whose id could not be read, moved aside by a pop or a sweep,
        newest first (see :class:`~durable_trio.brokers.SupportsQuarantine`)."""
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        entries: list[QuarantinedEntry] = await self._call(
            partial(ops.quarantined, queue, limit), write=False
        )
        return entries

    async def wait_for_work(self, queue: str) -> None:
        """Return when ``queue`` may have work (see the module docstring).

        A look that fails returns after ``wakeup_interval`` (the consumer's next pop meets
        the error and reports it); only a closed broker raises
        (:class:`~durable_trio.BrokerUnavailable`).

        Returns at once if a job is ready or a delayed one is due; otherwise when this broker
        pushes or hands back a job on ``queue``, when another broker's doorbell ring names
        ``queue``, when another connection committed and the queue then has work (checked
        every ``wakeup_interval``), or when the earliest delayed job comes due. It may return
        spuriously; it never misses a push that follows this broker's last empty pop.
        """
        waiter = Waiter(queue)
        self._wakeups.watch(waiter, listen=not self._closed)
        try:
            while True:
                waiter.event = trio.Event()  # before the look, so no ring slips in between
                try:
                    ready, due, version, limited = await self._call(
                        partial(ops.probe, queue), write=False
                    )
                except BrokerError:
                    if self._closed or self._db.closed:
                        raise  # closed: no pop will follow to say so
                    # The consumer's next pop meets the error and reports it (with its own
                    # backoff); a wait is no place to end the consumer's loop. One tick's
                    # pause first, so a look that keeps failing is no busy loop.
                    await trio.sleep(self.wakeup_interval)
                    return
                waiter.data_version = version
                waiter.due = due
                waiter.limited = limited
                if ready:
                    return
                deadline = math.inf
                if due is not None:
                    deadline = trio.current_time() + max(0.0, due - time.time())
                with trio.move_on_at(deadline):
                    await waiter.event.wait()
                if waiter.found_ready:
                    return  # the tick just looked: spare the round trip of a second look
        finally:
            self._wakeups.unwatch(waiter)
