"""The SQLite broker's tables: ``dt_jobs`` (every job, one row, its state a column), its partial
indexes, ``dt_quarantine`` (rows whose id could not be read), ``dt_limits`` (the queues'
fleet-wide concurrency limits), ``dt_rates`` and ``dt_rate_starts`` (rate limits,
:mod:`._rates`) and the columns added since the first release (migrated on
open). The file's settings (WAL, auto-vacuum) and ``dt_meta`` belong
to every connection (:mod:`durable_trio._sqlite`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ..._sqlite import META_TABLE
from ._rates import RATE_SCHEMA, add_rate_columns

if TYPE_CHECKING:
    import sqlite3

__all__ = ["SCHEMA", "create_schema"]

#: The statements that create the broker's tables if missing (idempotent).
SCHEMA: Final = (
    META_TABLE,
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
        ckey TEXT NOT NULL DEFAULT '',
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
    # Fleet-wide concurrency limits (``SupportsQueueLimits``): one row per limited queue. The
    # slots in use are never stored: a claim counts the queue's (or its key's) active rows,
    # so a slot comes back with its lease, however that ends.
    """
    CREATE TABLE IF NOT EXISTS dt_limits (
        queue TEXT PRIMARY KEY,
        lim INTEGER NOT NULL CHECK (lim >= 1),
        per_key INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID
    """,
)


def create_schema(db: sqlite3.Connection) -> None:
    """Create the broker's tables and indexes if missing and add the columns an older file
    lacks (in the caller's write transaction: two processes opening one file do it once)."""
    for statement in (*SCHEMA, *RATE_SCHEMA):
        db.execute(statement)
    _migrate(db)
    add_rate_columns(db)
    for statement in _ON_ADDED_COLUMNS:
        db.execute(statement)


#: Columns added to ``dt_jobs`` after its first release, each with its definition: a file made
#: before gets them on open (``ALTER TABLE ... ADD COLUMN``, in the schema's transaction, so two
#: processes opening one old file add it once). Rows from before have NULL there.
_ADDED_COLUMNS: Final = (("pushed_at", "REAL"), ("ckey", "TEXT NOT NULL DEFAULT ''"))


#: The indexes on added columns (made once they exist).
_ON_ADDED_COLUMNS: Final = (
    # A per-key limit's count of the claims per key. Partial on a key, so a claim of a job
    # without one (every job but a keyed step's) writes no entry here; the key ``""`` is
    # counted off ``dt_jobs_active``.
    """
    CREATE INDEX IF NOT EXISTS dt_jobs_active_key
        ON dt_jobs (queue, ckey) WHERE state = 'active' AND ckey != ''
    """,
)


def _migrate(db: sqlite3.Connection) -> None:
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(dt_jobs)")}
    for name, definition in _ADDED_COLUMNS:
        if name not in columns:
            db.execute(f"ALTER TABLE dt_jobs ADD COLUMN {name} {definition}")

