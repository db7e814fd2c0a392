"""The SQLite run store's dedup keys and debounced starts (issue 33, item 4): two tables and
the SQL of their changes, as plain functions on a connection (each runs in the connection
thread, inside the savepoint :class:`~.sqlite.SqliteRunStore` opened for it: atomic, and
serialized with every other writer of the file). ``_pg_tables.py`` holds PostgreSQL's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs

from .._records import RunRecord, RunStatus, read_trace
from .._tags import read_tags, tags_json
from . import _sqlite_tables as tables

if TYPE_CHECKING:
    import sqlite3

__all__ = [
    "STARTS_SCHEMA",
    "create_run_deduped",
    "create_schema",
    "debounce_run",
    "debounced_due",
    "start_debounced",
]

STARTS_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_dedup_keys (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        run_id TEXT NOT NULL,
        PRIMARY KEY (namespace, key)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE IF NOT EXISTS dt_debounced (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        run_id TEXT NOT NULL,
        workflow TEXT NOT NULL,
        input TEXT NOT NULL,
        timeout REAL,
        trace TEXT,
        due_at REAL NOT NULL,
        deadline REAL,
        PRIMARY KEY (namespace, key)
    ) WITHOUT ROWID
    """,
    # a run's dedup key row, deleted with the run by retention
    "CREATE INDEX IF NOT EXISTS dt_dedup_keys_run ON dt_dedup_keys (namespace, run_id)",
    "CREATE INDEX IF NOT EXISTS dt_debounced_due ON dt_debounced (namespace, due_at)",
    "CREATE INDEX IF NOT EXISTS dt_debounced_run ON dt_debounced (namespace, run_id)",
)


def create_schema(db: sqlite3.Connection) -> None:
    """The tables (issue 33, item 4), added to a file written before them when it is opened;
    a ``dt_debounced`` made before tags gets its ``tags`` column (NULL: none)."""
    for statement in STARTS_SCHEMA:
        db.execute(statement)
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(dt_debounced)")}
    if "tags" not in columns:
        db.execute("ALTER TABLE dt_debounced ADD COLUMN tags TEXT")


def create_run_deduped(
    ns: str, run: RunRecord, key: str, now: float, db: sqlite3.Connection
) -> tuple[RunRecord, bool]:
    row = db.execute(
        "SELECT run_id FROM dt_dedup_keys WHERE namespace = ? AND key = ?", (ns, key)
    ).fetchone()
    last = None if row is None else tables.get_run(ns, str(row[0]), db)
    if last is not None and not last.status.terminal:
        return last, False
    stored, created = tables.create_run(ns, run, now, db)
    if created:
        db.execute(
            "INSERT INTO dt_dedup_keys (namespace, key, run_id) VALUES (?, ?, ?) "
            "ON CONFLICT (namespace, key) DO UPDATE SET run_id = excluded.run_id",
            (ns, key, stored.run_id),
        )
    return stored, created


def debounce_run(
    ns: str,
    key: str,
    run: RunRecord,
    delay: float,
    max_wait: float | None,
    now: float,
    db: sqlite3.Connection,
) -> str:
    row = db.execute(
        "SELECT run_id, deadline FROM dt_debounced WHERE namespace = ? AND key = ?", (ns, key)
    ).fetchone()
    trace = None if run.trace is None else tables.dumps(run.trace)
    tags = tags_json(run.tags)
    if row is None:
        db.execute(
            "INSERT INTO dt_debounced (namespace, key, run_id, workflow, input, timeout, trace, "
            "due_at, deadline, tags) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (ns, key, run.run_id, run.workflow, tables.dumps(run.input), run.timeout, trace,
             now + delay, None if max_wait is None else now + max_wait, tags),
        )  # fmt: skip
        return run.run_id
    deadline = row[1] if isinstance(row[1], int | float) else None  # (damaged: no deadline)
    due = now + delay if deadline is None else min(now + delay, float(deadline))
    db.execute(
        "UPDATE dt_debounced SET input = ?, timeout = ?, trace = ?, due_at = ?, tags = ? "
        "WHERE namespace = ? AND key = ?",
        (tables.dumps(run.input), run.timeout, trace, due, tags, ns, key),
    )
    return str(row[0])


def start_debounced(
    ns: str, limit: int, now: float, db: sqlite3.Connection
) -> tuple[list[RunRecord], float | None]:
    due = db.execute(
        # (A due time that is no number, text or a blob: damaged data, and sorted above every
        # number, it was never due: due now. Its run is made, and set aside by its claim if
        # the rest of the row is damaged too.)
        "SELECT key, run_id, workflow, input, timeout, trace, tags FROM dt_debounced "
        "WHERE namespace = ? AND (due_at <= ? OR typeof(due_at) NOT IN ('integer', 'real')) "
        "ORDER BY due_at LIMIT ?",
        (ns, now, limit),
    ).fetchall()
    created: list[RunRecord] = []
    for key, run_id, workflow, text, timeout, trace, tags in due:
        db.execute("DELETE FROM dt_debounced WHERE namespace = ? AND key = ?", (ns, key))
        run = RunRecord(
            run_id=run_id,
            workflow=workflow,
            input=None,
            status=RunStatus.PENDING,
            created_at=now,
            updated_at=now,
            timeout=timeout,
            trace=read_trace(trace),
            tags=read_tags(tags),
        )
        stored, fresh = tables.create_run(ns, run, now, db)
        if fresh:
            # (Its input as stored: JSON text, never decoded and encoded again on the way.)
            db.execute(
                "UPDATE dt_runs SET input = ? WHERE namespace = ? AND run_id = ?",
                (text, ns, run_id),
            )
            value, readable = tables.started_input(run_id, text)
            if readable:  # (else its claim sets it aside)
                created.append(attrs.evolve(stored, input=value))
    (soonest,) = db.execute(
        "SELECT min(due_at) FROM dt_debounced "
        "WHERE namespace = ? AND typeof(due_at) IN ('integer', 'real')",
        (ns,),
    ).fetchone()
    return created, None if soonest is None else float(soonest)


def debounced_due(ns: str, run_id: str, db: sqlite3.Connection) -> float | None:
    row = db.execute(
        "SELECT due_at FROM dt_debounced WHERE namespace = ? AND run_id = ?", (ns, run_id)
    ).fetchone()
    if row is None:
        return None
    return float(row[0]) if isinstance(row[0], int | float) else 0.0  # (damaged: due now)
