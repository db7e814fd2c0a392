"""The SQLite connection thread: one :mod:`sqlite3` connection owned by one thread, driven from
Trio without blocking the event loop (see :class:`ConnectionThread`), and the translation of
:class:`sqlite3.Error` into the package's error tree.

The broker, the key store and the run store on one file share one thread
(:meth:`ConnectionThread.acquire`, :meth:`ConnectionThread.release`), or each opens its own with
:func:`open_connection`.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import queue as _queue_mod
import sqlite3
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final, TypeVar
from urllib.parse import quote

import attrs
import outcome
import trio

from .._errors import BrokerError, BrokerUnavailable, ConfigError, StoreLost
from .._logs import get_logger
from ._file import (
    META_TABLE,
    ReadOnly,
    Synchronous,
    configure,
    configure_read_only,
    file_identity,
    identity_problem,
    read_stamp,
    say_stamp,
)

__all__ = [
    "IDENTITY_CHECK_INTERVAL",
    "MAINTENANCE_INTERVAL",
    "VACUUM_MIN_FREE_PAGES",
    "VACUUM_STEP_PAGES",
    "ConnectionThread",
    "open_connection",
    "translate_error",
]

T = TypeVar("T")

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

_log = get_logger("durable_trio")

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
        read_only: ``None`` (read and write), ``"ro"`` (SQLite's ``mode=ro``: reads only, a
            live file's changes seen as they commit) or ``"immutable"`` (``mode=ro`` and
            ``immutable=1``: no lock taken, no ``-shm`` needed, for a file nobody writes). A
            read-only connection refuses every ``write=True`` call with
            :class:`~durable_trio.BrokerError` (docs/decisions.md, "Read-only SQLite files").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        synchronous: Synchronous = "NORMAL",
        read_only: ReadOnly = None,
    ) -> None:
        if busy_timeout < 0:
            raise ConfigError(f"busy_timeout must be >= 0, not {busy_timeout!r}")
        if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ConfigError(f"unknown synchronous setting {synchronous!r}")
        self.path = os.fspath(path)
        self.read_only: ReadOnly = read_only
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
        self._wal_identity: tuple[int, int] | None = None
        """Its write-ahead log's (``<file>-wal``), once seen: SQLite removes it only when the
        last connection closes, so while this one is open it is the same file."""
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
        if write and self.read_only is not None:
            raise BrokerError(
                f"the SQLite file {self.path!r} is open read-only (this process cannot write "
                "it): nothing can be changed in it"
            )
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
        target, uri = self.path, self.path.startswith("file:")
        if self.read_only is not None and not uri:
            flags = "mode=ro&immutable=1" if self.read_only == "immutable" else "mode=ro"
            target, uri = f"file:{quote(os.path.abspath(self.path))}?{flags}", True
        try:
            self._db = sqlite3.connect(
                target,
                timeout=self._busy_timeout,
                isolation_level=None,
                cached_statements=256,
                uri=uri,
            )
        except sqlite3.Error as exc:
            self._open_error = exc
        else:
            self._identity = file_identity(self.path)
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
        problem = identity_problem(self.path, self._identity, self._stamp)
        if problem is None and (lost_log := self._wal_problem(db)) is not None:
            self.lost = lost_log
            _log.error("%s", self.lost)
            return False
        if problem is None and due and self._stamp is not None:
            self._stamp_checked = now
            try:
                found = read_stamp(db)
            except sqlite3.Error as exc:
                name = getattr(exc, "sqlite_errorname", "") or ""
                if not name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
                    return True  # (busy, I/O: not an answer; the operation meets it itself)
                found = None  # no longer a database at all
            if found != self._stamp:
                problem = (
                    "was overwritten in place by another file (same inode; its store stamp "
                    f"is {say_stamp(found)}, this connection's {self._stamp})"
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

    def _wal_problem(self, db: sqlite3.Connection) -> str | None:
        """(In the connection thread.) What happened to the write-ahead log this connection
        writes, or ``None``: it is still the one at ``<file>-wal``.

        Removed (or replaced) under live processes, the connections that had it open go on
        committing into a file nobody else reaches (gone for good if the process is killed),
        while a process started since fails at once (``disk I/O error``, a short read). Found
        so, what this connection's log holds is written back into the file first (a
        checkpoint reads it through the connection's own descriptor), then the connection
        refuses every call as for a deleted file."""
        wal = f"{self.path}-wal"
        found = file_identity(wal)
        if self._wal_identity is None:
            self._wal_identity = found  # (none yet: SQLite makes it at the first write)
            return None
        if found == self._wal_identity:
            return None
        what = "was deleted" if found is None else "was replaced by another file"
        try:
            ((busy, frames, copied),) = db.execute("PRAGMA wal_checkpoint(FULL)").fetchall()
        except sqlite3.Error as exc:
            saved = f"what it held could not be written back into the file: {exc}"
        else:
            saved = (
                "what it held was written back into the file"
                if not busy and copied >= frames
                else f"only {copied} of its {frames} pages could be written back into the file"
            )
        return (
            f"the write-ahead log {wal!r} of the SQLite file {self.path!r} {what} while this "
            f"process had it open ({saved}); this connection refuses every call rather than "
            "write where no other process reads, and processes started since fail to read the "
            "file: stop every process on it (SIGTERM: a clean close writes back what its log "
            "holds), then start them again"
        )

    def _deliver(self, request: _Request, result: outcome.Outcome[Any]) -> None:
        with self._lock:
            detached = request.state is _State.DETACHED
            request.state = _State.DONE
        if detached:
            return
        # RunFinishedError: the caller's trio.run is gone; nobody waits for this answer.
        with contextlib.suppress(trio.RunFinishedError):
            request.trio_token.run_sync_soon(trio.lowlevel.reschedule, request.task, result)


def _stamp_store(connection: ConnectionThread, db: sqlite3.Connection) -> int | None:
    """Write the store stamp if the file has none yet (the first opener's wins) and note it
    (a read-only connection only reads it)."""
    if connection.read_only is None:
        db.execute(META_TABLE)
        db.execute("INSERT OR IGNORE INTO dt_meta (name, value) VALUES ('store', random())")
    stamp = read_stamp(db)
    if stamp is not None:
        connection.note_stamp(stamp)
    return stamp


async def open_connection(
    path: str | os.PathLike[str],
    *,
    busy_timeout: float = 5.0,
    synchronous: Synchronous = "NORMAL",
    read_only: ReadOnly = None,
) -> ConnectionThread:
    """Start a :class:`ConnectionThread` on ``path`` in WAL mode with ``busy_timeout`` and
    ``synchronous`` set (see :meth:`~durable_trio.brokers.sqlite.SqliteBroker.open` for the
    options), the file's identity noted (see :class:`ConnectionThread`, "The file's identity").
    ``read_only`` (see :class:`ConnectionThread`): the file is read as it is, nothing set or
    written.

    Raises:
        ConfigError: an invalid option.
        BrokerUnavailable: the file cannot be opened or stays locked.
        BrokerError: any other SQLite error, or WAL mode refused.
    """
    connection = ConnectionThread(
        path, busy_timeout=busy_timeout, synchronous=synchronous, read_only=read_only
    )
    try:
        if read_only is None:
            await connection.call(partial(configure, synchronous, busy_timeout), write=False)
        else:
            await connection.call(partial(configure_read_only, busy_timeout), write=False)
        await connection.call(partial(_stamp_store, connection), write=read_only is None)
    except BaseException:
        await connection.aclose()
        raise
    return connection

