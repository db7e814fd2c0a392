"""Reading the SQLite broker's stored rows: every field checked, what fails named as damage.

SQLite keeps any storage class in any column, and another program may write the file: a TEXT
or an INTEGER where this broker writes a BLOB, junk in the stall history, TEXT that is not
UTF-8. Every field a row hands over is checked here first, on the Python side of the one row
the statement returned. A field that fails never raises (that would roll the pop back, and the
same row would come first again at every pop): it becomes the claim's ``damage``, which the
transport fails with the reason while the row keeps its stored values; a row whose id cannot
be read at all is moved to the quarantine in the same transaction (:func:`readable_id`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final

import attrs

from .._contract import ClaimedJob, FailedJob, Lease, Stall
from .._stalls import parse_stalls, stalls_json

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Sequence

__all__ = [
    "DAMAGE_NOTE",
    "DELETE_ROW",
    "as_bytes",
    "describe",
    "fetch",
    "parse_stalls",
    "read_failed",
    "read_job",
    "readable_id",
    "stalls_json",
]

# ``error`` on a row that is not failed, after DAMAGE_NOTE, is the damage the broker found
# while moving it (its next claim carries it as ``ClaimedJob.damage``; ``_operations.py``
# writes it when it promotes a delayed row whose due_at is not a number).
DAMAGE_NOTE: Final = "damaged: "

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

DELETE_ROW: Final = "DELETE FROM dt_jobs WHERE pk = ?1"


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


def fetch(db: sqlite3.Connection, sql: str, params: Sequence[object]) -> list[Any]:
    """Run ``sql`` and fetch its rows, a TEXT that is not UTF-8 read as :class:`_BadText`
    instead of the driver raising. Only for this statement: a key store shares the connection."""
    db.text_factory = _text_factory
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.text_factory = str


def describe(value: object) -> str:
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


def as_bytes(value: object) -> bytes:
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
    return None, f"id: {describe(value)}, not UTF-8 TEXT"


def _read_data(value: object, problems: list[str]) -> bytes:
    if type(value) is bytes:
        return value
    if type(value) is str:
        # What a producer in another language naturally writes (JSON as TEXT): its UTF-8.
        return value.encode()
    if type(value) is _BadText:
        return bytes(value)  # TEXT but not UTF-8: the bytes as stored, for the decoder to judge
    problems.append(f"data: {describe(value)}, not BLOB or TEXT")
    return as_bytes(value)


def _read_int(name: str, value: object, problems: list[str], *, count: bool) -> int:
    if type(value) is int and (not count or 0 <= value < _MAX_COUNT):
        return value
    problems.append(f"{name}: {describe(value)}, not {'a count' if count else 'an INTEGER'}")
    return 0




def _read_stalls(value: object, problems: list[str]) -> tuple[Stall, ...]:
    stalls = parse_stalls(value)
    if stalls is None:
        problems.append(f"stalls: {describe(value)}, not a stall history")
        return ()
    return stalls


def read_job(
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
        if type(note) is str and note.startswith(DAMAGE_NOTE):
            problems.append(note[len(DAMAGE_NOTE) :])
        else:
            problems.append(f"error: {describe(note)}, set on a job that is not failed")
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


def readable_id(
    db: sqlite3.Connection, pk: int, value: object, now: float
) -> tuple[str | None, list[str], ClaimedJob | None]:
    """Read the id of row ``pk``: ``(id, problems, None)``, a UTF-8 BLOB id rewritten as TEXT;
    or, unreadable, ``(None, [], report)`` with the row moved to the quarantine."""
    job_id, damage = _read_id(value)
    if job_id is None:
        assert damage is not None
        db.execute(_QUARANTINE, (pk, damage, now))
        db.execute(DELETE_ROW, (pk,))
        shown = as_bytes(value).decode("utf-8", "replace")
        return None, [], ClaimedJob(id=shown, data=b"", lease=Lease(shown, ""), damage=damage)
    if damage is not None:
        db.execute(_NORMALIZE_ID, (job_id, pk))
        return job_id, [damage], None
    return job_id, [], None


def read_failed(row: Sequence[object]) -> FailedJob:
    """A failed row as stored, every field checked: what cannot be read is rendered (the raw
    bytes kept) and named at the end of ``error``."""
    raw_id, data, error, failed_at, attempts, stalled_count, stalls = row
    problems: list[str] = []
    job_id, id_damage = _read_id(raw_id)
    if id_damage is not None:
        problems.append(id_damage)
    if type(error) is not str:
        problems.append(f"error: {describe(error)}, not TEXT")
    at = 0.0
    if isinstance(failed_at, (int, float)):
        at = float(failed_at)
    else:
        problems.append(f"failed_at: {describe(failed_at)}, not a time")
    read = FailedJob(
        id=job_id if job_id is not None else as_bytes(raw_id).decode("utf-8", "replace"),
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


