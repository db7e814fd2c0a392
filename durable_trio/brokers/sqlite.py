"""The SQLite broker: the embedded, durable default (one machine, many processes, no server).

Open one with :meth:`SqliteBroker.open` and close it with :meth:`SqliteBroker.aclose` (or use it
as an async context manager)::

    broker = await SqliteBroker.open("/var/lib/app/durable.db")
    async with broker:
        await broker.push_on("q", Job("1", b"{}"))

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

    Across processes, the *doorbell* (``_doorbell.py``) comes first: a broker with waiters
    binds a Unix datagram socket in ``<db file>.bells/``, and every broker, right after
    committing something that can make work ready on a queue (a push, a held retry, a requeue,
    recovered stalls...), sends from its connection thread one non-blocking datagram naming
    that queue to every other socket there. The receiver wakes that queue's waiters, which
    return without a look of their own (their consumer's pop is the look); a ring that names
    no queue (a delayed push: nothing to pop yet) makes the receiver's thread tick instead.
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

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import queue as _queue_mod
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar
from urllib.parse import quote

import attrs
import outcome
import trio

from .._errors import BrokerError, BrokerUnavailable, ConfigError, StoreLost
from ._contract import (
    ClaimedJob,
    FailedJob,
    Job,
    JobState,
    Lease,
    QuarantinedEntry,
    QueueStats,
    Recovery,
    RenewOutcome,
    Stall,
)
from ._doorbell import Doorbell

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from types import TracebackType

__all__ = [
    "PROMOTE_BATCH",
    "WAKEUP_INTERVAL",
    "ConnectionThread",
    "SqliteBroker",
    "open_connection",
    "translate_error",
]

T = TypeVar("T")

#: Due delayed jobs promoted per pop at most, so one pop never does unbounded work.
PROMOTE_BATCH: Final = 256

#: The default safety-net tick (seconds): the doorbell wakes waiters across processes, the
#: tick only catches what it misses.
WAKEUP_INTERVAL: Final = 0.5

#: Seconds between two reads of the file's store stamp (see ``ConnectionThread``, "The file's
#: identity"); its path is looked at (one ``stat``) before every write besides.
IDENTITY_CHECK_INTERVAL: Final = 1.0

#: Seconds after a write before the connection thread, once idle, looks for free pages to
#: give back (see ``ConnectionThread``, "Giving space back").
MAINTENANCE_INTERVAL: Final = 10.0

#: Free pages a file holds before they are given back (4 MiB at SQLite's default 4 KiB page).
VACUUM_MIN_FREE_PAGES: Final = 1024

#: Pages given back per transaction at most (each a short write lock), one step at a time.
VACUUM_STEP_PAGES: Final = 1024

#: The WAL file is cut back to this size after a checkpoint (``PRAGMA journal_size_limit``).
WAL_SIZE_LIMIT: Final = 64 * 1024 * 1024

_log = logging.getLogger("durable_trio")

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

_UNAVAILABLE_CODES: Final = (
    "SQLITE_BUSY",
    "SQLITE_LOCKED",
    "SQLITE_IOERR",
    "SQLITE_CANTOPEN",
    "SQLITE_FULL",
    "SQLITE_PROTOCOL",
    "SQLITE_NOLFS",
)


def translate_error(exc: sqlite3.Error) -> BrokerError:
    """Map a :mod:`sqlite3` error onto the package's error tree.

    Args:
        exc: the error the driver raised.

    Returns:
        :class:`BrokerUnavailable` for a locked or busy database (past ``busy_timeout``), I/O
        errors, a full disk or a file that cannot be opened; :class:`BrokerError` otherwise.
        The caller raises it ``from exc``.
    """
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    if name.startswith(_UNAVAILABLE_CODES) or (
        not name and ("locked" in text or "disk I/O" in text or "unable to open" in text)
    ):
        hint = ""
        if name.startswith("SQLITE_FULL"):
            # Transient like a lock: every loop reports it and tries again once space returns.
            hint = "; free space on its disk: every write is tried again until it fits"
        return BrokerUnavailable(
            f"SQLite database unavailable: {text} ({name or 'no code'}){hint}"
        )
    return BrokerError(f"SQLite error: {text} ({name or type(exc).__name__})")


# ---------------------------------------------------------------------------- connection thread


class _State(enum.Enum):
    QUEUED = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()
    DROPPED = enum.auto()
    """Cancelled while still queued: the thread skips it."""
    DETACHED = enum.auto()
    """Cancelled, but runs anyway (close): the thread does not report back."""


class _RolledBack(Exception):
    """The caller was cancelled while its transaction ran; the thread rolled it back."""


@attrs.define(eq=False, slots=True)
class _Request:
    fn: Callable[[sqlite3.Connection], Any] | None
    """``None``: the close request."""
    write: bool
    task: trio.lowlevel.Task
    trio_token: trio.lowlevel.TrioToken
    detach_on_cancel: bool = False
    after_commit: Callable[[Any], None] | None = None
    state: _State = _State.QUEUED
    cancel_requested: bool = False


class ConnectionThread:
    """One SQLite connection owned by one thread, driven from Trio without blocking the loop.

    Operations are executed one at a time, in submission order, each as one transaction.
    Several users (a broker and a key store on the same file) may share one thread; it closes
    when the last of them releases it.

    The file's identity:
        A connection keeps the file it opened even when that file is deleted or replaced
        (``rm``, a restore copied over it by ``mv``): it would go on writing to a file no other
        process reaches, while new processes use the new file at that path. So the thread
        notes the file's device and inode at open, and the store stamp (a random number
        written once into ``dt_meta`` by the first opener of the file); it looks at the path
        again before every write and every :data:`IDENTITY_CHECK_INTERVAL` seconds of reads
        or waiting (one ``stat``), and reads the stamp again at that interval (a file copied
        over in place keeps its inode, not its stamp). Once either differs, the connection is
        *lost* (:attr:`lost` says what happened): every later call raises
        :class:`~durable_trio.StoreLost` naming it and touches the file no more; the error is
        logged once. A new connection (a restarted process) opens what is at the path now.
        A ``file:`` URI or an in-memory database is not looked at.

    Giving space back:
        SQLite keeps the pages a drained backlog freed for its next writes: the file does not
        shrink by itself. A new file is created with ``auto_vacuum=INCREMENTAL``, and
        :data:`MAINTENANCE_INTERVAL` seconds after a write, when no operation waits, the
        thread gives free pages back (``PRAGMA incremental_vacuum``) once there are at least
        :data:`VACUUM_MIN_FREE_PAGES`, at most :data:`VACUUM_STEP_PAGES` per transaction
        (taken only if the write lock is free at once: a busy file waits for a quieter
        moment), then lets a passive checkpoint shrink the file. A file made before (with
        ``auto_vacuum=NONE``) is left as it is: ``VACUUM`` it once, offline, to convert it
        (docs/deployment.md, "SQLite notes").

    Args:
        path: the database file.
        busy_timeout: seconds a statement waits for another connection's lock before failing
            with :class:`~durable_trio.BrokerUnavailable`.
        synchronous: SQLite's ``synchronous`` setting. ``NORMAL`` (the default) in WAL mode
            survives any process crash; an OS crash or power loss may lose the last
            transactions (never corrupts the file). ``FULL`` also survives power loss, at one
            ``fsync`` per commit.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        synchronous: Synchronous = "NORMAL",
    ) -> None:
        if busy_timeout < 0:
            raise ConfigError(f"busy_timeout must be >= 0, not {busy_timeout!r}")
        if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ConfigError(f"unknown synchronous setting {synchronous!r}")
        self.path = os.fspath(path)
        self._busy_timeout = busy_timeout
        self._synchronous: Synchronous = synchronous
        self._requests: _queue_mod.SimpleQueue[_Request | None] = _queue_mod.SimpleQueue()
        """Operations in submission order; ``None`` is a poke (see :meth:`poke`)."""
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._open_error: sqlite3.Error | None = None
        self._closing = False
        self._users = 1
        self.executed = 0
        """Operations the thread has run (statistics: the benchmark's queries per second)."""
        self.ticks = 0
        """Times the thread ran the tick hook."""
        self.dropped = 0
        """Operations cancelled while queued, so never run."""
        self.rolled_back = 0
        """Operations cancelled while running, rolled back instead of committed."""
        self._tick_hook: Callable[[sqlite3.Connection], None] | None = None
        self._tick_wanted: Callable[[], bool] = bool
        self._tick_interval = math.inf
        self._tick_soon = False
        """Set by :meth:`tick_now`: run the tick at the thread's next wake-up."""
        self._identity: tuple[int, int] | None = None
        """The opened file's (device, inode); ``None``: not looked at."""
        self._stamp: int | None = None
        """The store stamp read at open (``None``: not read yet)."""
        self._stamp_checked = -math.inf
        self._maintain_at: float | None = None
        """When (``time.monotonic()``) the idle thread next looks for free pages; ``None``:
        no write since the last look."""
        self._vacuums = True
        """Whether the file gives space back (``auto_vacuum=INCREMENTAL``), until seen not."""
        self.pages_freed = 0
        """Free pages given back to the file system (statistics)."""
        self.lost: str | None = None
        """What happened to the file, once it was found deleted or replaced (see "The file's
        identity"); ``None`` while it is the one opened."""
        self._thread = threading.Thread(
            target=self._serve, name=f"durable-trio-sqlite:{self.path}", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether the connection is closed or closing."""
        return self._closing

    def set_tick_hook(
        self,
        hook: Callable[[sqlite3.Connection], None],
        wanted: Callable[[], bool],
        interval: float,
    ) -> None:
        """Have the thread call ``hook(connection)`` every ``interval`` seconds while
        ``wanted()`` is true (between operations, in autocommit mode; the hook must not raise).

        ``wanted`` is read by the thread whenever it wakes; after it turns true, call
        :meth:`poke` so a thread asleep with nothing to do starts ticking.
        """
        self._tick_hook = hook
        self._tick_wanted = wanted
        self._tick_interval = interval

    def poke(self) -> None:
        """Wake the thread so it looks at the tick hook's ``wanted()`` again."""
        self._requests.put(None)

    def tick_now(self) -> None:
        """Have the thread run the tick hook as soon as it is free (if ``wanted()``), without
        waiting for the interval: a doorbell ring that names no queue. Thread-safe, never
        blocks."""
        self._tick_soon = True
        self._requests.put(None)

    def acquire(self) -> None:
        """Register one more user; each user calls :meth:`release` once."""
        if self._closing:
            raise BrokerUnavailable(f"the SQLite connection to {self.path!r} is closed")
        self._users += 1

    async def release(self) -> None:
        """Drop one user; the last one closes the connection (see :meth:`aclose`)."""
        self._users -= 1
        if self._users <= 0:
            await self.aclose()
        else:
            await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Close the connection after every operation submitted before. Idempotent.

        Cancelling the wait does not stop the close: the thread still closes the connection.
        """
        if self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._closing = True
        # Enqueued before the first checkpoint, so it happens even if the wait is cancelled.
        await self._submit(None, write=False, detach_on_cancel=True)

    async def call(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        write: bool,
        after_commit: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn(connection)`` in the connection thread as one transaction.

        Args:
            fn: the operation; it must not commit or roll back itself.
            write: open the transaction with ``BEGIN IMMEDIATE`` (take the write lock at once)
                and ``COMMIT`` it; otherwise ``fn`` runs in autocommit mode (read only).
            after_commit: called with ``fn``'s result in the connection thread right after the
                transaction committed (the doorbell's ring: it then reaches other processes
                without waiting for this event loop's turn); what it raises is ignored.

        Returns:
            What ``fn`` returned, once its transaction committed.

        Raises:
            trio.Cancelled: cancelled before the transaction committed; nothing changed.
            BrokerUnavailable: the connection is closed, or SQLite could not reach the file.
            BrokerError: any other SQLite error (the transaction was rolled back).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closing:
                raise BrokerUnavailable(f"the SQLite connection to {self.path!r} is closed")
            try:
                result: T = await self._submit(
                    fn, write=write, detach_on_cancel=False, after_commit=after_commit
                )
            except _RolledBack:
                # The cancellation that made the thread roll back is still pending: deliver it.
                # (Should it have vanished, nothing happened yet, so run the operation again.)
                await trio.lowlevel.checkpoint()
                continue
            return result

    async def _submit(
        self,
        fn: Callable[[sqlite3.Connection], Any] | None,
        *,
        write: bool,
        detach_on_cancel: bool,
        after_commit: Callable[[Any], None] | None = None,
    ) -> Any:
        request = _Request(
            fn=fn,
            write=write,
            task=trio.lowlevel.current_task(),
            trio_token=trio.lowlevel.current_trio_token(),
            detach_on_cancel=detach_on_cancel,
            after_commit=after_commit,
        )
        self._requests.put(request)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            with self._lock:
                state = request.state
                if state is _State.DONE:
                    return trio.lowlevel.Abort.FAILED  # the reschedule is on its way
                if request.detach_on_cancel:
                    request.state = _State.DETACHED
                    return trio.lowlevel.Abort.SUCCEEDED
                if state is _State.QUEUED:
                    request.state = _State.DROPPED
                    return trio.lowlevel.Abort.SUCCEEDED
                request.cancel_requested = True  # RUNNING: roll back unless already committing
                return trio.lowlevel.Abort.FAILED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    # -- in the connection thread

    def _serve(self) -> None:
        try:
            self._db = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout,
                isolation_level=None,
                cached_statements=256,
                uri=self.path.startswith("file:"),
            )
        except sqlite3.Error as exc:
            self._open_error = exc
        else:
            self._identity = _file_identity(self.path)
        next_tick: float | None = None
        while True:
            timeout: float | None = None
            if self._tick_hook is not None and self._db is not None and self._tick_wanted():
                now = time.monotonic()
                if self._tick_soon or (next_tick is not None and now >= next_tick):
                    self._tick_soon = False  # cleared first: a ring during the tick is kept
                    self.ticks += 1
                    self._tick_hook(self._db)
                    next_tick = time.monotonic() + self._tick_interval
                    continue
                if next_tick is None:
                    next_tick = now + self._tick_interval
                timeout = next_tick - now
            else:
                next_tick = None
                self._tick_soon = False
            if self._maintain_at is not None and self._db is not None:
                now = time.monotonic()
                if now >= self._maintain_at and self._requests.empty():
                    self._maintain_at = self._maintain(self._db)
                    continue
                wait = max(0.0, self._maintain_at - now)  # (due, operations first)
                timeout = wait if timeout is None else min(timeout, wait)
            try:
                request = self._requests.get(timeout=timeout)
            except _queue_mod.Empty:
                continue
            if request is None:
                continue  # a poke: look at the tick hook again
            with self._lock:
                if request.state is _State.DROPPED:
                    self.dropped += 1
                    continue
                if request.state is _State.QUEUED:
                    request.state = _State.RUNNING
            if request.fn is None:
                result: outcome.Outcome[Any] = outcome.Value(None)
                if self._db is not None:
                    try:
                        self._db.close()
                    except sqlite3.Error as exc:
                        result = outcome.Error(translate_error(exc))
                    self._db = None
                self._deliver(request, result)
                return
            self._deliver(request, self._execute(request))

    def _execute(self, request: _Request) -> outcome.Outcome[Any]:
        db = self._db
        fn = request.fn
        assert fn is not None
        self.executed += 1
        if db is None:
            error = self._open_error
            assert error is not None
            translated = translate_error(error)
            translated.__cause__ = error
            return outcome.Error(translated)
        try:
            found = self.check_identity(db, write=request.write)
        except Exception:  # (never the thread's end: the operation runs as it would have)
            found = True
        if not found:
            assert self.lost is not None
            return outcome.Error(StoreLost(self.lost))
        try:
            try:
                if request.write:
                    db.execute("BEGIN IMMEDIATE")
                value = fn(db)
                if request.cancel_requested:
                    self.rolled_back += 1
                    raise _RolledBack
                if request.write:
                    db.execute("COMMIT")
                    if self._maintain_at is None and self._vacuums:
                        self._maintain_at = time.monotonic() + MAINTENANCE_INTERVAL
            except BaseException:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):  # the original error says more
                        db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            translated = translate_error(exc)
            translated.__cause__ = exc
            return outcome.Error(translated)
        except BaseException as exc:
            return outcome.Error(exc)
        if request.after_commit is not None:
            with contextlib.suppress(Exception):  # committed: the caller gets its result
                request.after_commit(value)
        return outcome.Value(value)

    def _maintain(self, db: sqlite3.Connection) -> float | None:
        """(In the connection thread, idle.) Give back up to :data:`VACUUM_STEP_PAGES` free
        pages if the file holds :data:`VACUUM_MIN_FREE_PAGES` or more (see "Giving space
        back"). Never waits for a lock and never raises: a step that cannot run now is tried
        again later. Returns when to look again (``None``: after the next write)."""
        try:
            if self._closing or not self.check_identity(db, write=True):
                return None  # (a lost file is written no more, not even to tidy it)
            ((mode,),) = db.execute("PRAGMA auto_vacuum").fetchall()
            if mode != 2:  # NONE or FULL: nothing to do here, ever
                self._vacuums = False
                return None
            ((free,),) = db.execute("PRAGMA freelist_count").fetchall()
            if free < VACUUM_MIN_FREE_PAGES:
                return None
            db.execute("PRAGMA busy_timeout = 0")  # the lock now or a later try, never a wait
            try:
                # (executescript: the driver steps a lone PRAGMA incremental_vacuum only once,
                # which frees one page.)
                db.executescript(
                    f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({VACUUM_STEP_PAGES}); COMMIT;"
                )
            finally:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            ((left,),) = db.execute("PRAGMA freelist_count").fetchall()
            self.pages_freed += max(0, free - left)
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # the file shrinks now
        except Exception:  # (busy or failing: later; never the thread's end)
            return time.monotonic() + MAINTENANCE_INTERVAL
        # More to give back: the next step soon (operations queued meanwhile go first).
        return time.monotonic() + 0.05 if left >= VACUUM_MIN_FREE_PAGES else None

    def note_stamp(self, stamp: int) -> None:
        """(In the connection thread.) The store stamp read at open (see "The file's
        identity")."""
        self._stamp = stamp
        self._stamp_checked = time.monotonic()

    def check_identity(self, db: sqlite3.Connection, *, write: bool = False) -> bool:
        """(In the connection thread.) Whether the file at the path is still the one this
        connection opened: its path looked at if ``write`` or if :data:`IDENTITY_CHECK_INTERVAL`
        passed since the last look, its stamp read at that interval. Once not, :attr:`lost`
        says why (logged once) and this stays false."""
        if self.lost is not None:
            return False
        if self._identity is None:
            return True
        now = time.monotonic()
        due = now - self._stamp_checked >= IDENTITY_CHECK_INTERVAL
        if not (write or due):
            return True
        problem = _identity_problem(self.path, self._identity, self._stamp)
        if problem is None and due and self._stamp is not None:
            self._stamp_checked = now
            try:
                found = _read_stamp(db)
            except sqlite3.Error as exc:
                name = getattr(exc, "sqlite_errorname", "") or ""
                if not name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
                    return True  # (busy, I/O: not an answer; the operation meets it itself)
                found = None  # no longer a database at all
            if found != self._stamp:
                problem = (
                    "was overwritten in place by another file (same inode; its store stamp "
                    f"is {_say_stamp(found)}, this connection's {self._stamp})"
                )
        if problem is None:
            return True
        self.lost = (
            f"the SQLite file {self.path!r} {problem}: this process's connection still holds "
            "the old file, which no other process reaches, so it refuses every call rather "
            "than write there; restart the process to use the file now at that path"
        )
        _log.error("%s", self.lost)
        return False

    def _deliver(self, request: _Request, result: outcome.Outcome[Any]) -> None:
        with self._lock:
            detached = request.state is _State.DETACHED
            request.state = _State.DONE
        if detached:
            return
        # RunFinishedError: the caller's trio.run is gone; nobody waits for this answer.
        with contextlib.suppress(trio.RunFinishedError):
            request.trio_token.run_sync_soon(trio.lowlevel.reschedule, request.task, result)


# ------------------------------------------------------------------------------------- schema

_PRAGMAS_CHECK_WAL: Final = "PRAGMA journal_mode=WAL"

_META: Final = """
    CREATE TABLE IF NOT EXISTS dt_meta (
        name TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    ) WITHOUT ROWID
"""

_SCHEMA: Final = (
    _META,
    "INSERT OR IGNORE INTO dt_meta (name, value) VALUES ('seq', 0)",
    """
    CREATE TABLE IF NOT EXISTS dt_jobs (
        pk INTEGER PRIMARY KEY,
        queue TEXT NOT NULL,
        id TEXT NOT NULL,
        data BLOB NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        seq INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('ready', 'delayed', 'active', 'failed')),
        due_at REAL,
        token TEXT,
        claimed_at REAL,
        worker TEXT NOT NULL DEFAULT '',
        attempts INTEGER NOT NULL DEFAULT 0,
        stalled_count INTEGER NOT NULL DEFAULT 0,
        stalls TEXT NOT NULL DEFAULT '[]',
        error TEXT,
        failed_at REAL,
        pushed_at REAL,
        CHECK ((state = 'active') = (token IS NOT NULL AND claimed_at IS NOT NULL)),
        CHECK ((state = 'delayed') = (due_at IS NOT NULL))
    )
    """,
    # Partial indexes: each row sits only in the index of its state, so a state change touches
    # two small indexes, and every lookup below is a B-tree search plus the rows it returns.
    """
    CREATE INDEX IF NOT EXISTS dt_jobs_ready
        ON dt_jobs (queue, priority, seq) WHERE state = 'ready'
    """,
    """
    CREATE INDEX IF NOT EXISTS dt_jobs_delayed
        ON dt_jobs (queue, due_at, seq) WHERE state = 'delayed'
    """,
    """
    CREATE INDEX IF NOT EXISTS dt_jobs_active
        ON dt_jobs (queue, claimed_at) WHERE state = 'active'
    """,
    "CREATE INDEX IF NOT EXISTS dt_jobs_token ON dt_jobs (token) WHERE state = 'active'",
    "CREATE INDEX IF NOT EXISTS dt_jobs_failed ON dt_jobs (queue, seq) WHERE state = 'failed'",
    # Rows whose id could not be read (so no lease can name them), moved here whole: ``raw``
    # is every stored field as an SQL literal (``quote()``), then ``data`` as stored, for a
    # person to read.
    """
    CREATE TABLE IF NOT EXISTS dt_quarantine (
        pk INTEGER PRIMARY KEY,
        queue TEXT NOT NULL,
        reason TEXT NOT NULL,
        raw BLOB NOT NULL,
        at REAL NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS dt_quarantine_queue ON dt_quarantine (queue, pk)",
)

_NEXT_SEQ: Final = "UPDATE dt_meta SET value = value + ?1 WHERE name = 'seq' RETURNING value"

_INSERT: Final = """
    INSERT INTO dt_jobs (queue, id, data, priority, seq, state, due_at, pushed_at)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
"""

# The second half finds delayed rows whose due_at is not a number (TEXT or BLOB, which SQLite
# sorts after every number, so ``>= ''`` is an index range that is empty in the normal case):
# such a row would never come due, so it is promoted at once, marked as damaged.
_DUE_DELAYED: Final = """
    SELECT pk, 0 FROM (
        SELECT pk FROM dt_jobs
        WHERE state = 'delayed' AND queue = ?1 AND due_at <= ?2
        ORDER BY due_at, seq LIMIT ?3
    )
    UNION ALL
    SELECT pk, 1 FROM (
        SELECT pk FROM dt_jobs WHERE state = 'delayed' AND queue = ?1 AND due_at >= '' LIMIT ?3
    )
"""

_PROMOTE: Final = "UPDATE dt_jobs SET state = 'ready', due_at = NULL, seq = ?1 WHERE pk = ?2"

# ``error`` on a row that is not failed, after _DAMAGE_NOTE, is the damage the broker found
# while moving it (its next claim carries it as ``ClaimedJob.damage``): the unreadable due_at
# itself is about to be overwritten, so its value is kept in the note.
_DAMAGE_NOTE: Final = "damaged: "
_PROMOTE_DAMAGED: Final = """
    UPDATE dt_jobs SET state = 'ready', due_at = NULL, seq = ?1,
        error = 'damaged: due_at: not a number: ' || substr(quote(due_at), 1, 200)
    WHERE pk = ?2
"""

_CLAIM_NEXT: Final = """
    UPDATE dt_jobs SET state = 'active', token = ?1, claimed_at = ?2,
        worker = CASE
            WHEN typeof(stalled_count) = 'integer' AND stalled_count > 0
                AND substr(?3, 1, 1) != char(1)
            THEN char(1) || ?3 ELSE ?3 END
    WHERE pk = (
        SELECT pk FROM dt_jobs WHERE state = 'ready' AND queue = ?4
        ORDER BY priority, seq LIMIT 1
    )
    RETURNING pk, id, data, priority, attempts, stalled_count, stalls, error,
        substr(worker, 1, 1) != char(1)
"""

# A claim whose id was a UTF-8 BLOB gets it back as TEXT: a lease names its job by a string,
# and a BLOB never equals one.
_NORMALIZE_ID: Final = "UPDATE dt_jobs SET id = ?1 WHERE pk = ?2"

# A row whose id cannot be read at all, moved to the quarantine whole, in the transaction that
# found it (never dropped, never left in place to come first again at every pop). ``data`` goes
# last as its stored bytes: quote() would double a BLOB, and past SQLite's length limit the
# statement, and with it the pop, would fail.
_QUARANTINE: Final = """
    INSERT INTO dt_quarantine (queue, reason, raw, at)
    SELECT queue, ?2, CAST(
        'id=' || quote(id) || ' priority=' || quote(priority)
        || ' attempts=' || quote(attempts) || ' stalled_count=' || quote(stalled_count)
        || ' stalls=' || quote(stalls) || ' worker=' || quote(worker)
        || ' error=' || quote(error) || ' data=' || ifnull(data, 'NULL') AS BLOB), ?3
    FROM dt_jobs WHERE pk = ?1
"""

_DELETE_ROW: Final = "DELETE FROM dt_jobs WHERE pk = ?1"

_QUARANTINED: Final = """
    SELECT reason, raw, at FROM dt_quarantine WHERE queue = ?1 ORDER BY pk DESC LIMIT ?2
"""

# Lease checks go through the token index (``INDEXED BY``: never the per-queue claim index).
_COMPLETE: Final = """
    DELETE FROM dt_jobs INDEXED BY dt_jobs_token
    WHERE state = 'active' AND token = ?1 AND queue = ?2 AND id = ?3
"""

_FAIL: Final = """
    UPDATE dt_jobs INDEXED BY dt_jobs_token
    SET state = 'failed', token = NULL, claimed_at = NULL, error = ?4, failed_at = ?5, seq = ?6
    WHERE state = 'active' AND token = ?1 AND queue = ?2 AND id = ?3
"""

_PRUNE_FAILED: Final = """
    DELETE FROM dt_jobs
    WHERE state = 'failed' AND queue = ?1 AND seq <= (
        SELECT seq FROM dt_jobs WHERE state = 'failed' AND queue = ?1
        ORDER BY seq DESC LIMIT 1 OFFSET ?2
    )
"""

_RETRY: Final = """
    UPDATE dt_jobs INDEXED BY dt_jobs_token
    SET state = ?4, due_at = ?5, seq = COALESCE(?6, seq), attempts = attempts + ?7,
        token = NULL, claimed_at = NULL
    WHERE state = 'active' AND token = ?1 AND queue = ?2 AND id = ?3
"""

#: The first character of the ``worker`` of a claim popped ahead and not started yet (see
#: ``SupportsClaimAhead``): a claim popped for a free slot is started and stores its worker
#: as is, so the default path writes nothing more.
_AHEAD: Final = "\x01"

_MARK_STARTED: Final = """
    UPDATE dt_jobs INDEXED BY dt_jobs_token SET claimed_at = ?4,
        worker = CASE WHEN substr(worker, 1, 1) = char(1) THEN substr(worker, 2) ELSE worker END
    WHERE state = 'active' AND token = ?1 AND queue = ?2 AND id = ?3
"""

_RENEW: Final = """
    UPDATE dt_jobs INDEXED BY dt_jobs_token SET claimed_at = ?4
    WHERE state = 'active' AND token = ?1 AND queue = ?2 AND id = ?3
"""

# As in _DUE_DELAYED, the second half finds claims whose claimed_at would never look old
# enough: infinite, TEXT or BLOB (all sort from 9e999, SQLite's +Inf, up). They are taken back
# as damaged: a claim is always stamped with a finite time.
_STALLED: Final = """
    SELECT pk, id, data, priority, attempts, stalled_count, stalls, worker, claimed_at, error
    FROM dt_jobs INDEXED BY dt_jobs_active
    WHERE state = 'active' AND queue = ?1 AND claimed_at < ?2
    UNION ALL
    SELECT pk, id, data, priority, attempts, stalled_count, stalls, worker, claimed_at, error
    FROM dt_jobs INDEXED BY dt_jobs_active
    WHERE state = 'active' AND queue = ?1 AND claimed_at >= 9e999
    ORDER BY claimed_at
"""

_REQUEUE_STALLED: Final = """
    UPDATE dt_jobs SET state = 'ready', token = NULL, claimed_at = NULL,
        stalled_count = ?1, stalls = ?2
    WHERE pk = ?3
"""

_RELEASE_POISON: Final = """
    UPDATE dt_jobs SET token = ?1, claimed_at = ?2, stalled_count = ?3, stalls = ?4
    WHERE pk = ?5
"""

# A damaged stalled claim is re-leased to the sweep with its stored fields left as found.
_RELEASE_DAMAGED: Final = "UPDATE dt_jobs SET token = ?1, claimed_at = ?2 WHERE pk = ?3"

_SIZE: Final = """
    SELECT (SELECT count(*) FROM dt_jobs WHERE state = 'ready' AND queue = ?1)
         + (SELECT count(*) FROM dt_jobs WHERE state = 'delayed' AND queue = ?1)
"""

_FAILED_JOBS: Final = """
    SELECT id, data, error, failed_at, attempts, stalled_count, stalls
    FROM dt_jobs WHERE state = 'failed' AND queue = ?1
    ORDER BY seq DESC LIMIT ?2
"""

# The third column: a delayed row whose due_at is not a number (the next pop promotes it).
_PROBE: Final = """
    SELECT EXISTS (SELECT 1 FROM dt_jobs WHERE state = 'ready' AND queue = ?1),
           (SELECT due_at FROM dt_jobs WHERE state = 'delayed' AND queue = ?1
            ORDER BY due_at LIMIT 1),
           EXISTS (SELECT 1 FROM dt_jobs WHERE state = 'delayed' AND queue = ?1 AND due_at >= '')
"""


def _switch_to_wal(db: sqlite3.Connection, busy_timeout: float) -> object:
    """``PRAGMA journal_mode=WAL``, tried again for up to ``busy_timeout`` seconds while the
    file is locked.

    On a new file (still in rollback mode) this connection holds a shared lock and needs an
    exclusive one; while another opener holds its reserved lock (switching too, or creating
    its tables) SQLite answers SQLITE_BUSY at once, without its busy handler (waiting could
    deadlock: each would wait for the other). The statement's end releases our shared lock,
    so the other opener goes on and a later try here succeeds: a worker and an engine started
    together on a new file both come up (issue 36).
    """
    deadline = time.monotonic() + busy_timeout
    delay = 0.001
    while True:
        try:
            (mode,) = db.execute(_PRAGMAS_CHECK_WAL).fetchone()
        except sqlite3.OperationalError as exc:
            busy = (getattr(exc, "sqlite_errorname", "") or "").startswith("SQLITE_BUSY")
            if not busy or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)  # (in the connection thread: the event loop goes on)
            delay = min(delay * 2, 0.05)
        else:
            return mode


def _configure(synchronous: Synchronous, busy_timeout: float, db: sqlite3.Connection) -> None:
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    ((pages,),) = db.execute("PRAGMA page_count").fetchall()
    if pages == 0:
        # A new file (it takes effect with the first table); an older one keeps its mode.
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
    db.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    mode = _switch_to_wal(db, busy_timeout)
    if str(mode).lower() not in ("wal", "memory"):
        raise BrokerError(f"could not switch the SQLite database to WAL mode (got {mode!r})")
    db.execute(f"PRAGMA synchronous = {synchronous}")


def _file_identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the file at ``path``; ``None`` for a ``file:`` URI, an in-memory
    database or a file that cannot be looked at (then it is not checked)."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _identity_problem(path: str, identity: tuple[int, int], stamp: int | None) -> str | None:
    """What happened to the file opened as ``identity`` (its store stamp ``stamp``) at
    ``path``, or ``None``: it is still there."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return "was deleted"
    except OSError:
        return None  # cannot look (a permission changed): the statement will say more
    if (found.st_dev, found.st_ino) == identity:
        return None
    found_stamp: int | None = None
    with contextlib.suppress(sqlite3.Error):  # (a file SQLite cannot read has no stamp)
        other = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=0.1)
        try:
            found_stamp = _read_stamp(other)
        finally:
            other.close()
    if found_stamp is None:
        what = "a file that is not a durable_trio store, or a new one not yet opened"
    elif found_stamp == stamp:
        what = "a copy of this store, a restored backup perhaps"
    else:
        what = f"another durable_trio store, stamp {found_stamp}, this one's {stamp}"
    return (
        f"was replaced by another file (inode {identity[1]} then, {found.st_ino} now: {what})"
    )


def _read_stamp(db: sqlite3.Connection) -> int | None:
    """The store stamp in ``dt_meta`` (``None``: none, or no such table).

    Raises:
        sqlite3.Error: the file could not be read (busy, I/O, not a database).
    """
    try:
        row = db.execute("SELECT value FROM dt_meta WHERE name = 'store'").fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return row[0] if row is not None and type(row[0]) is int else None


def _say_stamp(stamp: int | None) -> str:
    return "missing" if stamp is None else str(stamp)


def _stamp_store(connection: ConnectionThread, db: sqlite3.Connection) -> int | None:
    """Write the store stamp if the file has none yet (the first opener's wins) and note it."""
    db.execute(_META)
    db.execute("INSERT OR IGNORE INTO dt_meta (name, value) VALUES ('store', random())")
    stamp = _read_stamp(db)
    if stamp is not None:
        connection.note_stamp(stamp)
    return stamp


async def open_connection(
    path: str | os.PathLike[str],
    *,
    busy_timeout: float = 5.0,
    synchronous: Synchronous = "NORMAL",
) -> ConnectionThread:
    """Start a :class:`ConnectionThread` on ``path`` in WAL mode with ``busy_timeout`` and
    ``synchronous`` set (see :meth:`SqliteBroker.open` for the options), the file's identity
    noted (see :class:`ConnectionThread`, "The file's identity").

    Raises:
        ConfigError: an invalid option.
        BrokerUnavailable: the file cannot be opened or stays locked.
        BrokerError: any other SQLite error, or WAL mode refused.
    """
    connection = ConnectionThread(path, busy_timeout=busy_timeout, synchronous=synchronous)
    try:
        await connection.call(partial(_configure, synchronous, busy_timeout), write=False)
        await connection.call(partial(_stamp_store, connection), write=True)
    except BaseException:
        await connection.aclose()
        raise
    return connection


def _create_schema(statements: Iterable[str], db: sqlite3.Connection) -> None:
    for statement in statements:
        db.execute(statement)
    _migrate(db)


#: Columns added to ``dt_jobs`` after its first release, each with its definition: a file made
#: before gets them on open (``ALTER TABLE ... ADD COLUMN``, in the schema's transaction, so two
#: processes opening one old file add it once). Rows from before have NULL there.
_ADDED_COLUMNS: Final = (("pushed_at", "REAL"),)


def _migrate(db: sqlite3.Connection) -> None:
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(dt_jobs)")}
    for name, definition in _ADDED_COLUMNS:
        if name not in columns:
            db.execute(f"ALTER TABLE dt_jobs ADD COLUMN {name} {definition}")


def _next_seq(db: sqlite3.Connection, count: int = 1) -> int:
    """Reserve ``count`` sequence numbers; returns the first. One counter for the whole file."""
    ((last,),) = db.execute(_NEXT_SEQ, (count,)).fetchall()
    return int(last) - count + 1


def _stalls_json(stalls: Sequence[Stall]) -> str:
    return json.dumps(
        [
            {"at": s.at, "worker": s.worker} if s.counted
            else {"at": s.at, "worker": s.worker, "counted": False}
            for s in stalls
        ]
    )


def _probe_one(db: sqlite3.Connection, queue: str, now: float) -> tuple[bool, float | None]:
    ((has_ready, due, due_unreadable),) = _fetch(db, _PROBE, (queue,))
    due_at = float(due) if type(due) in (int, float) else None
    # A due_at that is not a number counts as due: the next pop promotes it (as damaged).
    ready = bool(has_ready) or bool(due_unreadable) or (due_at is not None and due_at <= now)
    return ready, due_at


def _data_version(db: sqlite3.Connection) -> int:
    ((version,),) = db.execute("PRAGMA data_version").fetchall()
    return int(version)


# -- reading stored rows
#
# SQLite keeps any storage class in any column, and another program may write the file: a TEXT
# or an INTEGER where this broker writes a BLOB, junk in the stall history, TEXT that is not
# UTF-8. Every field a row hands over is checked here first, on the Python side of the one row
# the statement returned. A field that fails never raises (that would roll the pop back, and the
# same row would come first again at every pop): it becomes the claim's ``damage``, which the
# transport fails with the reason while the row keeps its stored values; a row whose id cannot
# be read at all is moved to the quarantine in the same transaction.

#: Counts (attempts, stalled_count) from 2**53 up are not ones this broker wrote (and one more
#: stall would overflow SQLite's INTEGER near the top of its range).
_MAX_COUNT: Final = 2**53


class _BadText(bytes):
    """A TEXT value that is not valid UTF-8 (another program wrote it): its stored bytes."""

    __slots__ = ()


def _text_factory(raw: bytes) -> str | bytes:
    # The driver's own decoding raises on invalid UTF-8 and fails the whole statement.
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return _BadText(raw)


def _fetch(db: sqlite3.Connection, sql: str, params: Sequence[object]) -> list[Any]:
    """Run ``sql`` and fetch its rows, a TEXT that is not UTF-8 read as :class:`_BadText`
    instead of the driver raising. Only for this statement: a key store shares the connection."""
    db.text_factory = _text_factory
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.text_factory = str


def _describe(value: object) -> str:
    """A stored value for a damage reason: its storage class and a short preview."""
    if value is None:
        return "NULL"
    if isinstance(value, int):
        return f"INTEGER {value}"
    if isinstance(value, float):
        return f"REAL {value!r}"
    kind = "TEXT" if isinstance(value, (str, _BadText)) else "BLOB"
    assert isinstance(value, (str, bytes))
    shown = value[:40]  # never the repr of the whole value: it may be megabytes
    preview = repr(shown if isinstance(shown, str) else bytes(shown))
    return f"{kind} {preview}{'...' if len(value) > 40 else ''}"


def _as_bytes(value: object) -> bytes:
    """A stored value as bytes, for a person to read: BLOB and TEXT as stored, a number in
    decimal, NULL as ``b"NULL"``. (Never ``bytes(value)``: of an int, that allocates it.)"""
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if value is None:
        return b"NULL"
    return repr(value).encode()


def _read_id(value: object) -> tuple[str | None, str | None]:
    """The job id and what is wrong with it: ``(None, reason)`` when it cannot be read."""
    if type(value) is str:
        return value, None
    if type(value) is bytes:  # a BLOB (not a _BadText)
        with contextlib.suppress(UnicodeDecodeError):
            return value.decode(), "id: stored as BLOB, not TEXT"
    return None, f"id: {_describe(value)}, not UTF-8 TEXT"


def _read_data(value: object, problems: list[str]) -> bytes:
    if type(value) is bytes:
        return value
    if type(value) is str:
        # What a producer in another language naturally writes (JSON as TEXT): its UTF-8.
        return value.encode()
    if type(value) is _BadText:
        return bytes(value)  # TEXT but not UTF-8: the bytes as stored, for the decoder to judge
    problems.append(f"data: {_describe(value)}, not BLOB or TEXT")
    return _as_bytes(value)


def _read_int(name: str, value: object, problems: list[str], *, count: bool) -> int:
    if type(value) is int and (not count or 0 <= value < _MAX_COUNT):
        return value
    problems.append(f"{name}: {_describe(value)}, not {'a count' if count else 'an INTEGER'}")
    return 0


def _parse_stalls(value: object) -> tuple[Stall, ...] | None:
    if type(value) is not str:
        return None
    if value == "[]":
        return ()
    try:
        items = json.loads(value)
    except (ValueError, RecursionError):  # (ValueError: also an int of too many digits)
        return None
    if type(items) is not list:
        return None
    stalls = []
    for item in items:
        if type(item) is not dict:
            return None
        at, worker = item.get("at"), item.get("worker")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or type(worker) is not str:
            return None
        try:
            seconds = float(at)
        except OverflowError:  # an int past a float's range
            return None
        if not math.isfinite(seconds):
            return None
        counted = item.get("counted", True)
        if type(counted) is not bool:
            return None
        stalls.append(Stall(at=seconds, worker=worker, counted=counted))
    return tuple(stalls)


def _read_stalls(value: object, problems: list[str]) -> tuple[Stall, ...]:
    stalls = _parse_stalls(value)
    if stalls is None:
        problems.append(f"stalls: {_describe(value)}, not a stall history")
        return ()
    return stalls


def _read_job(
    job_id: str,
    token: str,
    row: Sequence[object],
    note: object,
    problems: list[str],
    *,
    started: bool = True,
) -> ClaimedJob:
    """A claim from ``row`` = (data, priority, attempts, stalled_count, stalls) as stored, every
    field checked; ``damage`` lists the fields that failed (``problems`` holds those found
    before). ``note``: the row's ``error`` column, the damage found while moving it."""
    data, priority, attempts, stalled_count, stalls = row
    if note is not None:
        if type(note) is str and note.startswith(_DAMAGE_NOTE):
            problems.append(note[len(_DAMAGE_NOTE) :])
        else:
            problems.append(f"error: {_describe(note)}, set on a job that is not failed")
    return ClaimedJob(
        id=job_id,
        data=_read_data(data, problems),
        lease=Lease(job_id, token),
        priority=_read_int("priority", priority, problems, count=False),
        attempts=_read_int("attempts", attempts, problems, count=True),
        stalled_count=_read_int("stalled_count", stalled_count, problems, count=True),
        stalls=_read_stalls(stalls, problems),
        started=started,
        damage="; ".join(problems) if problems else None,
    )


def _readable_id(
    db: sqlite3.Connection, pk: int, value: object, now: float
) -> tuple[str | None, list[str], ClaimedJob | None]:
    """Read the id of row ``pk``: ``(id, problems, None)``, a UTF-8 BLOB id rewritten as TEXT;
    or, unreadable, ``(None, [], report)`` with the row moved to the quarantine."""
    job_id, damage = _read_id(value)
    if job_id is None:
        assert damage is not None
        db.execute(_QUARANTINE, (pk, damage, now))
        db.execute(_DELETE_ROW, (pk,))
        shown = _as_bytes(value).decode("utf-8", "replace")
        return None, [], ClaimedJob(id=shown, data=b"", lease=Lease(shown, ""), damage=damage)
    if damage is not None:
        db.execute(_NORMALIZE_ID, (job_id, pk))
        return job_id, [damage], None
    return job_id, [], None


def _read_failed(row: Sequence[object]) -> FailedJob:
    """A failed row as stored, every field checked: what cannot be read is rendered (the raw
    bytes kept) and named at the end of ``error``."""
    raw_id, data, error, failed_at, attempts, stalled_count, stalls = row
    problems: list[str] = []
    job_id, id_damage = _read_id(raw_id)
    if id_damage is not None:
        problems.append(id_damage)
    if type(error) is not str:
        problems.append(f"error: {_describe(error)}, not TEXT")
    at = 0.0
    if isinstance(failed_at, (int, float)):
        at = float(failed_at)
    else:
        problems.append(f"failed_at: {_describe(failed_at)}, not a time")
    read = FailedJob(
        id=job_id if job_id is not None else _as_bytes(raw_id).decode("utf-8", "replace"),
        data=_read_data(data, problems),
        error=error if type(error) is str else "",
        failed_at=at,
        attempts=_read_int("attempts", attempts, problems, count=True),
        stalled_count=_read_int("stalled_count", stalled_count, problems, count=True),
        stalls=_read_stalls(stalls, problems),
    )
    # (A job failed as damaged already names its damage in its error.)
    unnamed = [problem for problem in problems if problem not in read.error]
    if not unnamed:
        return read
    return attrs.evolve(read, error=f"{read.error} [unreadable: {'; '.join(unnamed)}]".lstrip())


# -- operations (run in the connection thread, inside the transaction ``call`` opened)


def _op_push(queue: str, job: Job, priority: int, delay: float, db: sqlite3.Connection) -> None:
    seq = _next_seq(db)
    now = time.time()
    state, due_at = ("delayed", now + delay) if delay > 0 else ("ready", None)
    db.execute(_INSERT, (queue, job.id, job.data, priority, seq, state, due_at, now))


def _promote_due(db: sqlite3.Connection, queue: str, now: float) -> None:
    due = db.execute(_DUE_DELAYED, (queue, now, PROMOTE_BATCH)).fetchall()
    if due:
        first = _next_seq(db, len(due))
        promote = [(first + i, pk) for i, (pk, unreadable) in enumerate(due) if not unreadable]
        damaged = [(first + i, pk) for i, (pk, unreadable) in enumerate(due) if unreadable]
        db.executemany(_PROMOTE, promote)
        if damaged:
            db.executemany(_PROMOTE_DAMAGED, damaged)


def _claim_next(db: sqlite3.Connection, queue: str, worker: str, now: float) -> ClaimedJob | None:
    token = secrets.token_hex(8)
    rows = _fetch(db, _CLAIM_NEXT, (token, now, worker, queue))
    if not rows:
        return None
    ((pk, raw_id, *fields, note, started),) = rows
    job_id, problems, report = _readable_id(db, pk, raw_id, now)
    if job_id is None:
        return report
    # (a suspect, stalled before, is stored not started, like a claim popped ahead)
    return _read_job(job_id, token, fields, note, problems, started=bool(started))


def _op_pop(queue: str, worker: str, db: sqlite3.Connection) -> ClaimedJob | None:
    now = time.time()
    _promote_due(db, queue, now)
    return _claim_next(db, queue, worker, now)


def _op_pop_many(
    queue: str, count: int, worker: str, db: sqlite3.Connection, ahead: int = 0
) -> list[ClaimedJob]:
    now = time.time()
    _promote_due(db, queue, now)
    claimed: list[ClaimedJob] = []
    while len(claimed) < count + ahead:
        # The claims past ``count`` are popped ahead: not started (the marked worker).
        job = _claim_next(db, queue, worker if len(claimed) < count else _AHEAD + worker, now)
        if job is None:
            break
        claimed.append(job)
    return claimed


def _op_mark_started(queue: str, leases: Sequence[Lease], db: sqlite3.Connection) -> list[bool]:
    now = time.time()
    return [
        db.execute(_MARK_STARTED, (lease.token, queue, lease.job_id, now)).rowcount == 1
        for lease in leases
    ]


def _op_complete_many(leases: Sequence[Lease], queue: str, db: sqlite3.Connection) -> list[bool]:
    return [_op_complete(lease, queue, db) for lease in leases]


def _op_push_many(queue: str, pairs: list[tuple[Job, int | None]], db: sqlite3.Connection) -> None:
    for job, priority in pairs:
        _op_push(queue, job, priority or 0, 0.0, db)


def _op_complete(lease: Lease, queue: str, db: sqlite3.Connection) -> bool:
    return db.execute(_COMPLETE, (lease.token, queue, lease.job_id)).rowcount == 1


def _op_fail_and_push(
    lease: Lease,
    queue: str,
    error: str,
    retention: int,
    push_queue: str,
    job: Job,
    db: sqlite3.Connection,
) -> bool:
    if not _op_fail(lease, queue, error, retention, db):
        return False
    _op_push(push_queue, job, 0, 0.0, db)
    return True


def _op_fail(lease: Lease, queue: str, error: str, retention: int, db: sqlite3.Connection) -> bool:
    seq = _next_seq(db)
    params = (lease.token, queue, lease.job_id, error, time.time(), seq)
    if db.execute(_FAIL, params).rowcount != 1:
        return False
    db.execute(_PRUNE_FAILED, (queue, retention))
    return True


def _op_retry(
    lease: Lease, queue: str, delay: float, count_attempt: bool, db: sqlite3.Connection
) -> bool:
    # An immediate, attempt-neutral handback keeps the job's place in its queue (NULL: keep
    # the sequence); a retry goes to the back.
    keep_place = delay <= 0 and not count_attempt
    seq = None if keep_place else _next_seq(db)
    state, due_at = ("delayed", time.time() + delay) if delay > 0 else ("ready", None)
    params = (lease.token, queue, lease.job_id, state, due_at, seq, int(count_attempt))
    return db.execute(_RETRY, params).rowcount == 1


def _op_renew(queue: str, leases: Sequence[Lease], db: sqlite3.Connection) -> RenewOutcome:
    now = time.time()
    lost: list[Lease] = []
    renewed = 0
    for lease in leases:
        if db.execute(_RENEW, (lease.token, queue, lease.job_id, now)).rowcount == 1:
            renewed += 1
        else:
            lost.append(lease)
    return RenewOutcome(renewed=renewed, lost=tuple(lost))


def _op_recover(queue: str, threshold: float, max_stalled: int, db: sqlite3.Connection) -> Recovery:
    now = time.time()
    rows = _fetch(db, _STALLED, (queue, now - threshold))
    recovered = 0
    exceeded: list[ClaimedJob] = []
    for pk, raw_id, *fields, worker, claimed_at, note in rows:
        job_id, problems, report = _readable_id(db, pk, raw_id, now)
        if job_id is None:
            assert report is not None
            exceeded.append(report)
            continue
        if not isinstance(claimed_at, (int, float)) or not math.isfinite(claimed_at):
            problems.append(f"claimed_at: {_describe(claimed_at)}, not a time")
        if type(worker) is not str:
            problems.append(f"worker: {_describe(worker)}, not TEXT")
        token = secrets.token_hex(8)
        job = _read_job(job_id, token, fields, note, problems)
        if job.damage is not None:
            # Re-leased to the sweep, which fails it: its stored fields stay as found.
            db.execute(_RELEASE_DAMAGED, (token, now, pk))
            exceeded.append(job)
            continue
        # Past the limit already: the lease of a sweep that found it exceeded and died before
        # failing it. No delivery, so no stall: exceeded again, as it was.
        again = job.stalled_count > max_stalled
        # Only a claim whose handler started counts: one popped ahead and never started
        # comes back at once, uncounted (recorded as such in its history).
        counted = not again and not worker.startswith(_AHEAD)
        stalls = job.stalls
        if not again:
            stalls = (*stalls, Stall(at=now, worker=worker.removeprefix(_AHEAD), counted=counted))
        stalled_count = job.stalled_count + counted
        if again or (counted and stalled_count > max_stalled):
            db.execute(_RELEASE_POISON, (token, now, stalled_count, _stalls_json(stalls), pk))
            exceeded.append(attrs.evolve(job, stalled_count=stalled_count, stalls=stalls))
        else:
            # A reclaimed job keeps its place: it waited its turn once already.
            db.execute(_REQUEUE_STALLED, (stalled_count, _stalls_json(stalls), pk))
            recovered += 1
    return Recovery(recovered=recovered, exceeded=tuple(exceeded))


def _op_size(queue: str, db: sqlite3.Connection) -> int:
    ((size,),) = db.execute(_SIZE, (queue,)).fetchall()
    return int(size)


_JOB_STATE: Final = """
    SELECT 1, worker FROM dt_jobs WHERE state = 'active' AND queue = ?1 AND id = ?2
    UNION ALL
    SELECT 0, '' FROM dt_jobs WHERE state = 'ready' AND queue = ?1 AND id = ?2
    UNION ALL
    SELECT 0, '' FROM dt_jobs WHERE state = 'delayed' AND queue = ?1 AND id = ?2
    LIMIT 1
"""


def _op_job_state(queue: str, job_id: str, db: sqlite3.Connection) -> JobState | None:
    rows = db.execute(_JOB_STATE, (queue, job_id)).fetchall()
    if not rows:
        return None
    claimed, worker = rows[0]
    if claimed:
        return JobState(claimed=True, worker=worker if isinstance(worker, str) else "")
    return JobState(claimed=False)


def _op_job_states(
    queue: str, job_ids: Sequence[str], db: sqlite3.Connection
) -> list[JobState | None]:
    found: dict[str, JobState] = {}
    for start in range(0, len(job_ids), 500):  # (SQLite's bound on host parameters)
        chunk = list(job_ids[start : start + 500])
        marks = ",".join("?" * len(chunk))
        rows = db.execute(
            f"SELECT id, state, worker FROM dt_jobs WHERE queue = ? AND id IN ({marks}) "
            "AND state IN ('active', 'ready', 'delayed')",
            (queue, *chunk),
        ).fetchall()
        for job_id, state, worker in rows:
            if state == "active":
                holder = worker if isinstance(worker, str) else ""
                found[job_id] = JobState(claimed=True, worker=holder)
            else:
                found.setdefault(job_id, JobState(claimed=False))
    return [found.get(job_id) for job_id in job_ids]


# The queues in [?1, ?2) of one state, read off that state's index in queue order.
_READY_QUEUES: Final = """
    SELECT DISTINCT queue FROM dt_jobs
    WHERE state = 'ready' AND queue >= ?1 AND queue < ?2 ORDER BY queue
"""
_DELAYED_QUEUES: Final = """
    SELECT DISTINCT queue FROM dt_jobs
    WHERE state = 'delayed' AND queue >= ?1 AND queue < ?2 ORDER BY queue
"""


def _op_waiting_queues(prefix: str, db: sqlite3.Connection) -> list[str]:
    bounds = (prefix, prefix + "\U0010ffff")  # every name that starts with the prefix
    return sorted(
        {str(q) for sql in (_READY_QUEUES, _DELAYED_QUEUES) for (q,) in db.execute(sql, bounds)}
    )


_NEWEST_FAILED: Final = """
    SELECT pk FROM dt_jobs WHERE state = 'failed' AND queue = ?1 AND id = ?2
    ORDER BY seq DESC LIMIT 1
"""

_REQUEUE_FAILED: Final = """
    UPDATE dt_jobs SET state = 'ready', seq = ?2, priority = coalesce(?3, priority),
        attempts = 0, stalled_count = 0, stalls = '[]', error = NULL, failed_at = NULL,
        worker = '', pushed_at = ?4
    WHERE pk = ?1
"""

# Each count on its state's partial index, in one statement (one snapshot). The ready rows are
# read whole for their push times (an operator's look, not the hot path: O(ready rows)): the
# oldest, and how many have none that can be read (NULL: pushed before the column existed;
# TEXT, BLOB or infinite: damaged), which make the oldest age unknown.
_STATS: Final = """
    SELECT ready.n, ready.oldest, ready.unknown,
           (SELECT count(*) FROM dt_jobs WHERE state = 'delayed' AND queue = ?1),
           (SELECT count(*) FROM dt_jobs WHERE state = 'active' AND queue = ?1),
           (SELECT count(*) FROM dt_jobs WHERE state = 'failed' AND queue = ?1)
    FROM (
        SELECT count(*) AS n, min(pushed_at) AS oldest,
            count(*) - count(CASE WHEN typeof(pushed_at) IN ('integer', 'real')
                AND abs(pushed_at) < 9e999 THEN 1 END) AS unknown
        FROM dt_jobs WHERE state = 'ready' AND queue = ?1
    ) AS ready
"""

# The queues in [?1, ?2) holding claimed or failed jobs (ready and delayed: _READY_QUEUES,
# _DELAYED_QUEUES), each read off its state's index in queue order.
_ACTIVE_QUEUES: Final = """
    SELECT DISTINCT queue FROM dt_jobs
    WHERE state = 'active' AND queue >= ?1 AND queue < ?2 ORDER BY queue
"""
_FAILED_QUEUES: Final = """
    SELECT DISTINCT queue FROM dt_jobs
    WHERE state = 'failed' AND queue >= ?1 AND queue < ?2 ORDER BY queue
"""


def _op_requeue_failed(
    queue: str, job_id: str, priority: int | None, db: sqlite3.Connection
) -> bool:
    row = db.execute(_NEWEST_FAILED, (queue, job_id)).fetchone()
    if row is None:
        return False
    db.execute(_REQUEUE_FAILED, (row[0], _next_seq(db), priority, time.time()))
    return True


def _op_delete_failed(queue: str, job_id: str, db: sqlite3.Connection) -> bool:
    row = db.execute(_NEWEST_FAILED, (queue, job_id)).fetchone()
    if row is None:
        return False
    db.execute(_DELETE_ROW, (row[0],))
    return True


def _op_queue_stats(queue: str, db: sqlite3.Connection) -> QueueStats:
    now = time.time()
    ((ready, oldest, unknown, delayed, active, failed),) = _fetch(db, _STATS, (queue,))
    age = None
    if ready and not unknown and isinstance(oldest, (int, float)):
        age = max(0.0, now - oldest)
    return QueueStats(int(ready), int(delayed), int(active), int(failed), age)


def _op_known_queues(prefix: str, db: sqlite3.Connection) -> list[str]:
    bounds = (prefix, prefix + "\U0010ffff")  # every name that starts with the prefix
    statements = (_READY_QUEUES, _DELAYED_QUEUES, _ACTIVE_QUEUES, _FAILED_QUEUES)
    return sorted({str(q) for sql in statements for (q,) in db.execute(sql, bounds)})


def _op_failed_jobs(queue: str, limit: int, db: sqlite3.Connection) -> list[FailedJob]:
    return [_read_failed(row) for row in _fetch(db, _FAILED_JOBS, (queue, limit))]


def _op_quarantined(queue: str, limit: int, db: sqlite3.Connection) -> list[QuarantinedEntry]:
    return [
        QuarantinedEntry(
            queue=queue,
            reason=_as_bytes(reason).decode("utf-8", "replace"),
            raw=_as_bytes(raw),
            at=float(at) if isinstance(at, (int, float)) else 0.0,
        )
        for reason, raw, at in _fetch(db, _QUARANTINED, (queue, limit))
    ]


def _op_probe(queue: str, db: sqlite3.Connection) -> tuple[bool, float | None, int]:
    # The version is read first: a commit the probe does not see changes it afterwards.
    version = _data_version(db)
    ready, due = _probe_one(db, queue, time.time())
    return ready, due, version


# ------------------------------------------------------------------------------------- broker


def _always(result: object) -> bool:
    """Ring after every commit of the operation (any push can make work ready)."""
    return True


@attrs.define(eq=False)
class _Waiter:
    queue: str
    event: trio.Event = attrs.Factory(trio.Event)
    data_version: int = -1
    """``PRAGMA data_version`` read just before this waiter's last look at its queue."""
    due: float | None = None
    """Wall-clock due time of the queue's earliest delayed job at that look."""
    found_ready: bool = False
    """Set by a tick that saw work on the queue, or by a doorbell ring naming it: the waiter
    returns without looking again (its consumer's pop looks)."""


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
        self._waiters: dict[str, set[_Waiter]] = {}
        self._watched: tuple[_Waiter, ...] = ()
        """Every waiter, copied on write: the connection thread's tick reads it unlocked."""
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._closed = False
        self.doorbell: Doorbell | None = (
            Doorbell(self.path, self._on_doorbell) if doorbell else None
        )
        connection.set_tick_hook(self._tick, lambda: bool(self._watched), wakeup_interval)

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

        Returns:
            The open broker; close it with :meth:`aclose` (or ``async with``).

        Raises:
            ConfigError: an invalid option.
            BrokerUnavailable: the file cannot be opened or stays locked.
            BrokerError: any other SQLite error (say, not a database).
        """
        connection = await open_connection(path, busy_timeout=busy_timeout, synchronous=synchronous)
        try:
            broker = cls(
                connection,
                wakeup_interval=wakeup_interval,
                failed_retention=failed_retention,
                doorbell=doorbell,
            )
            await connection.call(partial(_create_schema, _SCHEMA), write=True)
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
            partial(_op_push, queue, job, priority or 0, delay),
            write=True,
            ring=queue,
            ready=delay <= 0,
        )
        self._ring(queue)

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Promote due delayed jobs (at most :data:`PROMOTE_BATCH`), then claim the next
        ready job under a fresh random lease token, or return ``None``."""
        result: ClaimedJob | None = await self._call(partial(_op_pop, queue, worker), write=True)
        return result

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Like :meth:`pop_from`, claiming up to ``count`` jobs in one transaction, in pop
        order (an empty list: none ready)."""
        if count <= 0:
            await trio.lowlevel.checkpoint()
            return []
        claimed: list[ClaimedJob] = await self._call(
            partial(_op_pop_many, queue, count, worker), write=True
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
            partial(_op_pop_many, queue, count, worker, ahead=ahead), write=True
        )
        return claimed

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark claims popped ahead started, and renew them (one transaction)."""
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        marked: list[bool] = await self._call(
            partial(_op_mark_started, queue, tuple(leases)), write=True
        )
        return marked

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Delete a finished job. ``False``: the lease was lost, nothing changed."""
        done: bool = await self._call(partial(_op_complete, lease, queue), write=True)
        return done

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in one transaction."""
        done: list[bool] = await self._call(partial(_op_complete_many, leases, queue), write=True)
        return done

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job, in one transaction."""
        pairs = list(zip(jobs, priorities, strict=True))
        await self._call(partial(_op_push_many, queue, pairs), write=True, ring=queue)
        self._ring(queue)

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
            _op_push_many(push_queue, pairs, db)
            done = _op_complete_many(leases, queue, db)
            return done, _op_pop_many(queue, count, worker, db) if count > 0 else []

        answer: tuple[list[bool], list[ClaimedJob]] = await self._call(
            all_three, write=True, ring=push_queue
        )
        self._ring(push_queue)
        return answer

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good, kept for :meth:`failed_jobs`. ``False``: the lease was lost."""
        done: bool = await self._call(
            partial(_op_fail, lease, queue, error, self._failed_retention), write=True
        )
        return done

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """:meth:`fail_job`, then (if the lease held) push ``job`` onto ``push_queue``, in one
        transaction. ``False``: the lease was lost, nothing changed."""
        done: bool = await self._call(
            partial(_op_fail_and_push, lease, queue, error, self._failed_retention, push_queue,
                    job),
            write=True,
            ring=push_queue,
            ring_if=bool,
        )
        if done:
            self._ring(push_queue)
        return done

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds, at the back of its
        priority. ``count_attempt=False`` leaves ``attempts`` alone. ``False``: lease lost."""
        done: bool = await self._call(
            partial(_op_retry, lease, queue, delay, count_attempt),
            write=True,
            ring=queue,
            ring_if=bool,
            ready=delay <= 0,
        )
        if done:
            self._ring(queue)
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
            partial(_op_renew, queue, tuple(leases)), write=True
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
            partial(_op_recover, queue, threshold, max_stalled),
            write=True,
            ring=queue,
            ring_if=lambda recovery: recovery.recovered,
        )
        if result.recovered:
            self._ring(queue)
        return result

    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        size: int = await self._call(partial(_op_size, queue), write=False)
        return size

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs (see
        :class:`~durable_trio.brokers.SupportsQueueListing`)."""
        queues: list[str] = await self._call(partial(_op_waiting_queues, prefix), write=False)
        return queues

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed (see
        :class:`~durable_trio.brokers.SupportsJobState`)."""
        state: JobState | None = await self._call(
            partial(_op_job_state, queue, job_id), write=False
        )
        return state

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``, in one read (see
        :class:`~durable_trio.brokers.SupportsJobStates`)."""
        states: list[JobState | None] = await self._call(
            partial(_op_job_states, queue, list(job_ids)), write=False
        )
        return states

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        limit = min(limit, self._failed_retention)
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        jobs: list[FailedJob] = await self._call(
            partial(_op_failed_jobs, queue, limit), write=False
        )
        return jobs

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, its counters reset (see
        :class:`~durable_trio.brokers.SupportsFailedJobRepair`; its stored priority unless
        ``priority`` is given)."""
        done: bool = await self._call(
            partial(_op_requeue_failed, queue, job_id, priority),
            write=True,
            ring=queue,
            ring_if=bool,
        )
        if done:
            self._ring(queue)
        return done

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        done: bool = await self._call(partial(_op_delete_failed, queue, job_id), write=True)
        return done

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts and its oldest ready job's age, in one statement (one pass over
        the queue's ready rows for their ``pushed_at``). The age is ``None`` while a ready row
        has none that can be read: NULL (pushed before the column was added to an older
        file), TEXT, BLOB or infinite (damaged)."""
        stats: QueueStats = await self._call(partial(_op_queue_stats, queue), write=False)
        return stats

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed, failed)."""
        names: list[str] = await self._call(partial(_op_known_queues, prefix), write=False)
        return names

    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The rows of ``queue`` whose id could not be read, moved aside by a pop or a sweep,
        newest first (see :class:`~durable_trio.brokers.SupportsQuarantine`)."""
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        entries: list[QuarantinedEntry] = await self._call(
            partial(_op_quarantined, queue, limit), write=False
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
        waiter = _Waiter(queue)
        self._watch(waiter)
        try:
            while True:
                waiter.event = trio.Event()  # before the look, so no ring slips in between
                try:
                    ready, due, version = await self._call(
                        partial(_op_probe, queue), write=False
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
            self._unwatch(waiter)

    # -- wake-up internals

    def _ring(self, queue: str) -> None:
        """After a commit that can make work ready on ``queue``: wake this broker's waiters
        (the other brokers' doorbells were rung by the connection thread, see :meth:`_call`)."""
        for waiter in self._waiters.get(queue, ()):
            waiter.event.set()

    def _watch(self, waiter: _Waiter) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._waiters.setdefault(waiter.queue, set()).add(waiter)
        was_idle = not self._watched
        self._watched = (*self._watched, waiter)
        if was_idle and not self._db.closed:
            if self.doorbell is not None and not self._closed:
                self.doorbell.listen()  # before the waiter's first look: no ring slips by
            self._db.poke()  # the thread may sleep with nothing to do: start ticking

    def _unwatch(self, waiter: _Waiter) -> None:
        waiters = self._waiters.get(waiter.queue)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.queue]
        self._watched = tuple(w for w in self._watched if w is not waiter)

    def _on_doorbell(self, queues: frozenset[str] | None) -> None:
        """In the doorbell's receiving thread: other brokers pushed onto ``queues`` (``None``:
        onto queues they could not name). Waiters of those queues return at once, without a
        look (their consumer's pop is the look; a spurious return is allowed); unnamed queues
        make the connection thread tick now."""
        trio_token = self._trio_token
        if queues is None or trio_token is None:
            self._db.tick_now()
            return
        with contextlib.suppress(trio.RunFinishedError):
            trio_token.run_sync_soon(self._wake, queues)

    def _wake(self, queues: frozenset[str]) -> None:
        for queue in queues:
            for waiter in self._waiters.get(queue, ()):
                waiter.found_ready = True
                waiter.event.set()

    def _tick(self, db: sqlite3.Connection) -> None:
        """In the connection thread, every ``wakeup_interval`` while someone waits: did another
        connection commit since each waiter looked? Only then look again at those waiters'
        queues, and hand the answers to :meth:`_apply_tick` in the Trio thread."""
        watched = self._watched
        trio_token = self._trio_token
        if not watched or trio_token is None:
            return
        if self.doorbell is not None:
            self.doorbell.check()  # our socket removed by someone: bind a new one
        try:
            if not self._db.check_identity(db):
                # The file is gone: nobody else will commit to this one. The waiters look
                # for themselves and their calls raise StoreLost.
                raise StoreLost(self._db.lost or "")
            version = _data_version(db)
            stale = {w.queue for w in watched if w.data_version != version}
            if not stale:
                return
            now = time.time()
            found = {queue: _probe_one(db, queue, now) for queue in stale}
            callback = partial(self._apply_tick, version, found)
        except Exception:
            # Let the waiters look for themselves: their own call raises the error.
            callback = partial(self._apply_tick, None, None)
        with contextlib.suppress(trio.RunFinishedError):
            trio_token.run_sync_soon(callback)

    def _apply_tick(
        self, version: int | None, found: dict[str, tuple[bool, float | None]] | None
    ) -> None:
        """Wake the waiters whose queue has work or whose earliest due time moved."""
        if version is None or found is None:
            for waiter in self._watched:
                waiter.event.set()
            return
        for queue, (ready, due) in found.items():
            for waiter in self._waiters.get(queue, ()):
                if ready or due != waiter.due:
                    waiter.found_ready = ready
                    waiter.event.set()
                else:
                    waiter.data_version = version
