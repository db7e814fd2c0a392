"""The SQLite file's settings and identity: what every connection to a durable_trio file does
at open (WAL mode, ``busy_timeout``, ``synchronous``, incremental auto-vacuum on a new file,
the WAL size cap), and how a connection tells that the file at its path is still the one it
opened (its device and inode, and the store stamp in ``dt_meta``).

Plain functions on a :class:`sqlite3.Connection`, run in the connection thread
(``_connection.py``): nothing here knows the thread, the broker or its tables.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from typing import Final, Literal
from urllib.parse import quote

from .._backoff import Backoff
from .._errors import BrokerError

__all__ = [
    "META_TABLE",
    "WAL_SIZE_LIMIT",
    "ReadOnly",
    "Synchronous",
    "configure",
    "configure_read_only",
    "file_identity",
    "identity_problem",
    "read_stamp",
    "say_stamp",
]

#: How a connection opens its file read-only (``None``: read and write): ``"ro"`` is SQLite's
#: ``mode=ro``, ``"immutable"`` adds ``immutable=1`` (see ``ConnectionThread``).
ReadOnly = Literal["ro", "immutable"] | None

#: SQLite's ``synchronous`` settings.
Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

#: The WAL file is cut back to this size after a checkpoint (``PRAGMA journal_size_limit``).
WAL_SIZE_LIMIT: Final = 64 * 1024 * 1024

#: The pause between two tries of the switch to WAL while another opener holds the file's lock
#: (doubling from 1 ms up to 50 ms, no jitter: the wait is bounded by ``busy_timeout``).
_WAL_BACKOFF: Final = Backoff(initial=0.001, maximum=0.05)

_PRAGMAS_CHECK_WAL: Final = "PRAGMA journal_mode=WAL"

#: The file's own table: the sequence counter (``seq``) and the store stamp (``store``).
META_TABLE: Final = """
    CREATE TABLE IF NOT EXISTS dt_meta (
        name TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    ) WITHOUT ROWID
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
    failures = 0
    while True:
        try:
            (mode,) = db.execute(_PRAGMAS_CHECK_WAL).fetchone()
        except sqlite3.OperationalError as exc:
            busy = (getattr(exc, "sqlite_errorname", "") or "").startswith("SQLITE_BUSY")
            failures += 1
            delay = _WAL_BACKOFF.delay(failures)
            if not busy or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)  # (in the connection thread: the event loop goes on)
        else:
            return mode


def configure(synchronous: Synchronous, busy_timeout: float, db: sqlite3.Connection) -> None:
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


def configure_read_only(busy_timeout: float, db: sqlite3.Connection) -> None:
    """A read-only connection's settings: ``busy_timeout`` only (the file's journal mode and
    settings are read as they are), and a first read, so that a file that cannot be read
    fails here (not a database, a write-ahead log it cannot reach)."""
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    db.execute("SELECT count(*) FROM sqlite_master").fetchall()


def file_identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the file at ``path``; ``None`` for a ``file:`` URI, an in-memory
    database or a file that cannot be looked at (then it is not checked)."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def identity_problem(path: str, identity: tuple[int, int], stamp: int | None) -> str | None:
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
            found_stamp = read_stamp(other)
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


def read_stamp(db: sqlite3.Connection) -> int | None:
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


def say_stamp(stamp: int | None) -> str:
    return "missing" if stamp is None else str(stamp)


