"""The SQLite broker's rate limits (``SupportsRateLimits``): ``dt_rates`` (one row per rated
queue) and ``dt_rate_starts`` (the sliding-window log, one row per start). Each call is one
transaction; a take runs in a write transaction, which SQLite runs one at a time, so the count
it reads is exact however many processes take. The clock is ``time.time()``, read inside the
transaction, as every other operation of the broker."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from .._rates import KEY_SEPARATOR, grant, log_name

if TYPE_CHECKING:
    import sqlite3

__all__ = ["RATE_SCHEMA", "give_back", "set_rate", "take", "window"]

#: The statements that create the rate tables if missing (idempotent).
RATE_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_rates (
        queue TEXT PRIMARY KEY,
        count INTEGER NOT NULL CHECK (count >= 1),
        per REAL NOT NULL CHECK (per > 0)
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


def set_rate(queue: str, count: int | None, per: float, db: sqlite3.Connection) -> None:
    if count is None:
        db.execute("DELETE FROM dt_rates WHERE queue = ?1", (queue,))
    else:
        db.execute(
            "INSERT INTO dt_rates (queue, count, per) VALUES (?1, ?2, ?3) "
            "ON CONFLICT (queue) DO UPDATE SET count = excluded.count, per = excluded.per",
            (queue, count, per),
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


def window(queue: str, db: sqlite3.Connection) -> tuple[int | None, float | None, int]:
    """``(count, per, starts in the current window)`` (a read: nothing pruned)."""
    rate = _rate_of(db, queue)
    if rate is None:
        return None, None, 0
    count, per = rate
    ((n,),) = db.execute(
        "SELECT count(*) FROM dt_rate_starts WHERE queue = ?1 AND at > ?2",
        (queue, time.time() - per),
    ).fetchall()
    return count, per, int(n)
