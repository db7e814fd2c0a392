"""The SQLite broker's rate limits (``SupportsRateLimits``): ``dt_rates`` (one row per rated
queue) and ``dt_rate_starts`` (the sliding-window log, one row per start). Each call is one
transaction; a take runs in a write transaction, which SQLite runs one at a time, so the count
it reads is exact however many processes take. The clock is ``time.time()``, read inside the
transaction, as every other operation of the broker."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from .._rates import KEY_SEPARATOR, grant, log_name, window_fields

if TYPE_CHECKING:
    import sqlite3

__all__ = ["RATE_SCHEMA", "add_rate_columns", "give_back", "set_rate", "take", "window"]

#: The statements that create the rate tables if missing (idempotent).
RATE_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_rates (
        queue TEXT PRIMARY KEY,
        count INTEGER NOT NULL CHECK (count >= 1),
        per REAL NOT NULL CHECK (per > 0),
        per_key INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE IF NOT EXISTS dt_rate_starts (
        pk INTEGER PRIMARY KEY,
        queue TEXT NOT NULL,
        at REAL NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS dt_rate_starts_queue ON dt_rate_starts (queue, at)",
)


def add_rate_columns(db: sqlite3.Connection) -> None:
    """Add to a ``dt_rates`` made before per-key rates were shown its ``per_key`` column
    (rows from before read as keyless: each worker stores its flag again as it opens)."""
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(dt_rates)")}
    if "per_key" not in columns:
        db.execute("ALTER TABLE dt_rates ADD COLUMN per_key INTEGER NOT NULL DEFAULT 0")


def set_rate(
    queue: str, count: int | None, per: float, per_key: bool, db: sqlite3.Connection
) -> None:
    if count is None:
        db.execute("DELETE FROM dt_rates WHERE queue = ?1", (queue,))
    else:
        db.execute(
            "INSERT INTO dt_rates (queue, count, per, per_key) VALUES (?1, ?2, ?3, ?4) "
            "ON CONFLICT (queue) DO UPDATE SET count = excluded.count, per = excluded.per, "
            "per_key = excluded.per_key",
            (queue, count, per, int(per_key)),
        )


def _rate_of(db: sqlite3.Connection, queue: str) -> tuple[int, float] | None:
    row = db.execute("SELECT count, per FROM dt_rates WHERE queue = ?1", (queue,)).fetchone()
    if row is None or type(row[0]) is not int or not isinstance(row[1], (int, float)):
        return None
    return row[0], float(row[1])


def _live(db: sqlite3.Connection, queue: str, now: float, per: float) -> list[float]:
    db.execute("DELETE FROM dt_rate_starts WHERE queue = ?1 AND at <= ?2", (queue, now - per))
    return [
        float(row[0])
        for row in db.execute(
            "SELECT at FROM dt_rate_starts WHERE queue = ?1 ORDER BY at", (queue,)
        )
    ]


def take(
    queue: str, want: int, db: sqlite3.Connection, key: str | None = None
) -> tuple[int, float, float]:
    """``(granted, retry_after, at)`` (a write transaction). With ``key``: the key's log
    (``log_name``), held to ``queue``'s rate; the expired starts of every key of ``queue`` are
    dropped too, so an idle key leaves nothing behind."""
    now = time.time()
    rate = _rate_of(db, queue)
    if rate is None:
        return want, 0.0, now
    count, per = rate
    if key is not None:
        db.execute(
            "DELETE FROM dt_rate_starts WHERE queue > ?1 AND queue < ?2 AND at <= ?3",
            (queue + KEY_SEPARATOR, queue + chr(ord(KEY_SEPARATOR) + 1), now - per),
        )
    log = log_name(queue, key)
    granted, retry_after = grant(_live(db, log, now, per), now, want, count, per)
    if granted:
        db.executemany(
            "INSERT INTO dt_rate_starts (queue, at) VALUES (?1, ?2)", [(log, now)] * granted
        )
    return granted, retry_after, now


def give_back(queue: str, at: float, n: int, db: sqlite3.Connection) -> None:
    db.execute(
        "DELETE FROM dt_rate_starts WHERE pk IN "
        "(SELECT pk FROM dt_rate_starts WHERE queue = ?1 AND at = ?2 ORDER BY pk DESC LIMIT ?3)",
        (queue, at, n),
    )


def window(queue: str, db: sqlite3.Connection) -> dict[str, Any]:
    """The rate fields of ``queue``'s ``QueueStats`` (``window_fields``; a read: nothing
    pruned). A per-key rate counts each key's log (one grouped scan of the queue's keys)."""
    rate = _rate_of(db, queue)
    if rate is None:
        return {}
    count, per = rate
    since = time.time() - per
    row = db.execute("SELECT per_key FROM dt_rates WHERE queue = ?1", (queue,)).fetchone()
    if row is None or not row[0]:
        ((n,),) = db.execute(
            "SELECT count(*) FROM dt_rate_starts WHERE queue = ?1 AND at > ?2", (queue, since)
        ).fetchall()
        return window_fields(count, per, False, [int(n)])
    counts = db.execute(
        "SELECT count(*) FROM dt_rate_starts WHERE queue > ?1 AND queue < ?2 AND at > ?3 "
        "GROUP BY queue",
        (queue + KEY_SEPARATOR, queue + chr(ord(KEY_SEPARATOR) + 1), since),
    ).fetchall()
    return window_fields(count, per, True, [int(c) for (c,) in counts])
