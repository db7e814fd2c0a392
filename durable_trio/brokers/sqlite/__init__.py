"""The SQLite broker: the embedded, durable default (one machine, many processes, no server).

Open one with :meth:`SqliteBroker.open` and close it with :meth:`SqliteBroker.aclose` (or use it
as an async context manager)::

    broker = await SqliteBroker.open("/var/lib/app/durable.db")
    async with broker:
        await broker.push_on("q", Job("1", b"{}"))

Parts (one concern per module):
    ``_schema.py``, the tables, their indexes and migrations; ``_rows.py``, every stored field
    checked as it is read, the damage and the quarantine; ``_operations.py``, the SQL of each
    call as a plain function on a connection; ``_wakeup.py``, the waiters and what wakes them
    (the broker's own commits, the doorbell, the tick); ``_broker.py``, :class:`SqliteBroker`,
    which composes them with the connection thread of :mod:`durable_trio._sqlite` (shared with
    the key store and the run store on the same file; the doorbell lives there too).

Threading model:
    The stdlib :mod:`sqlite3` module blocks, so every broker owns **one dedicated connection
    thread** that holds its connection and runs one operation at a time, fed through a FIFO
    queue. A Trio task submits an operation and parks (``wait_task_rescheduled``) until the
    thread reschedules it; the event loop never blocks. Measured against a
    ``trio.to_thread.run_sync`` call per operation behind a ``CapacityLimiter(1)``, the
    dedicated thread is faster (an empty call ~110 µs against ~155 µs, push + pop + complete
    ~2,900 round trips/s against ~2,000, sequential or with 32 tasks, on a small 2-core VM):
    queued operations run back to back in the thread instead of each waiting for the limiter
    to be handed over through the event loop and a thread-cache worker. The dedicated thread
    also runs the wake-up tick itself (below), which a per-call thread could not.

Transactions and cancellation:
    Every operation is one transaction, ``BEGIN IMMEDIATE`` ... ``COMMIT`` for writes (so it is
    all or nothing, and never meets ``SQLITE_BUSY_SNAPSHOT``), executed entirely in the thread. A
    call cancelled while it still waits in the queue is dropped (it never runs). A call
    cancelled while its SQL runs is not abandoned: the thread checks for the cancellation just
    before ``COMMIT`` and rolls back instead, and the call raises :class:`trio.Cancelled`; if
    the cancellation comes after the commit, the call returns its result and the cancellation
    is delivered at the caller's next checkpoint. So a call that raised changed nothing, and a
    call that changed something returned its result: a cancelled pop never claims a job nobody
    tracks.

Clock:
    ``time.time()`` (the wall clock, which every process on one machine shares) read inside the
    transaction. Delays and thresholds are relative seconds on it.

Wake-up (:meth:`SqliteBroker.wait_for_work`):
    Pushes by this broker ring the waiters of their queue at once (an in-process event). Other
    connections' commits are noticed by a *tick* that the connection thread itself runs: it
    reads ``PRAGMA data_version`` (one cheap statement for all waiting queues, which changes
    only when another connection committed), and only then runs the "is anything ready or due"
    query, once per waiting queue whose answer may have changed, and hands the answers to the
    event loop. An idle tick never wakes the event loop; a broker nobody waits on does not tick.
    A waiter also wakes when its earliest delayed job comes due.

    Across processes, the *doorbell* (``durable_trio/_sqlite/_doorbell.py``) comes first: a
    broker with waiters binds a Unix datagram socket in ``<db file>.bells/``, and every broker,
    right after committing something that can make work ready on a queue (a push, a held
    retry, a requeue, recovered stalls...), sends from its connection thread one non-blocking
    datagram naming that queue to every other socket there. The receiver wakes that queue's
    waiters, which return without a look of their own (their consumer's pop is the look); a
    ring that names no queue (a delayed push: nothing to pop yet) makes the receiver's thread
    tick instead.
    Rings within 5 ms of a broker's last such wake-up are gathered into the next one (a dense
    stream then wakes a consumer once for several jobs). So a push in one process wakes an
    idle waiter in another within a millisecond or two. The doorbell is a hint only:
    the tick runs every ``wakeup_interval`` seconds (0.5 by default) while someone waits, and
    catches whatever the doorbell misses (no folder or a path too long for a socket, a socket
    file removed, a container that shares the file but not the folder, another program writing
    the file). A dead process's socket is unlinked by the next sender that finds it refusing.

Damaged rows:
    SQLite keeps any type in any column and another program may write the file, so every field
    a pop, a sweep or :meth:`SqliteBroker.failed_jobs` reads is checked on the Python side of
    the row first (no extra query). TEXT ``data`` is served as its UTF-8; a field of the wrong
    type or out of range makes the claim *damaged* (``ClaimedJob.damage``: the transport fails
    it unread, the row keeping its stored values); a row whose id cannot be read moves to the
    ``dt_quarantine`` table (:meth:`SqliteBroker.quarantined`) in the transaction that found
    it. Nothing stored ever makes an operation raise or roll back, so one bad row cannot wedge
    a queue by coming first again at every pop. (``pushed_at``, read only by
    :meth:`SqliteBroker.queue_stats`, makes an unreadable value an unknown age, ``None``.)

Errors:
    :class:`sqlite3.Error` is translated at this edge: a locked database (after
    ``busy_timeout``), I/O errors, a full disk or a file that cannot be opened raise
    :class:`~durable_trio.BrokerUnavailable`; anything else :class:`~durable_trio.BrokerError`.
"""

from ..._sqlite import ConnectionThread, Synchronous, open_connection, translate_error
from ._broker import WAKEUP_INTERVAL, SqliteBroker
from ._operations import PROMOTE_BATCH

__all__ = [
    "PROMOTE_BATCH",
    "WAKEUP_INTERVAL",
    "ConnectionThread",
    "SqliteBroker",
    "Synchronous",
    "open_connection",
    "translate_error",
]
