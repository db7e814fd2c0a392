"""Reading the PostgreSQL broker's stored rows: every field checked, what fails named as damage.

PostgreSQL enforces each column's type, so far less can go wrong than in a SQLite file, but
another program (or a person with ``psql``) may still write a row this broker would not: a
NULL id or data, a negative count, a stall history that is not one, a non-finite time. Every
field a claim or a failed job hands over is checked here, on the Python side of the row the
statement returned. A field that fails never raises (the same row would come first again at
every pop): it becomes the claim's ``damage``, which the transport fails with the reason while
the row keeps its stored values. A row whose id cannot be read (NULL: no lease can name it) is
moved to the quarantine by the caller (:data:`QUARANTINE_REASON`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

import attrs

from .._contract import ClaimedJob, FailedJob, Lease, Stall
from .._stalls import parse_stalls, stalls_json

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "DAMAGE_NOTE",
    "QUARANTINE_REASON",
    "describe",
    "parse_stalls",
    "read_failed",
    "read_job",
    "stalls_json",
    "unreadable_report",
]

#: ``note`` on a row starts with this when the broker found damage while moving it (a delayed
#: row whose ``due_at`` was not a time): its next claim carries it as ``ClaimedJob.damage``.
DAMAGE_NOTE: Final = "damaged: "

#: Why a row with a NULL id is moved to the quarantine.
QUARANTINE_REASON: Final = "id: NULL, not a job id"


def describe(value: object) -> str:
    """A stored value for a damage reason: a short preview, never the whole value."""
    if value is None:
        return "NULL"
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:60] + "..."


def _count(name: str, value: object, problems: list[str]) -> int:
    if type(value) is int and value >= 0:
        return value
    problems.append(f"{name}: {describe(value)}, not a count")
    return 0


def _data(value: object, problems: list[str]) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    problems.append(f"data: {describe(value)}, not bytes")
    return b""


def _stalls(value: object, problems: list[str]) -> tuple[Stall, ...]:
    stalls = parse_stalls(value)
    if stalls is None:
        problems.append(f"stalls: {describe(value)}, not a stall history")
        return ()
    return stalls


def read_job(
    job_id: str,
    token: str,
    row: Sequence[object],
    *,
    started: bool = True,
    problems: Sequence[str] = (),
) -> ClaimedJob:
    """A claim from ``row`` = (data, priority, attempts, stalled_count, stalls, note) as
    stored, every field checked; ``damage`` names those that failed (after ``problems``, found
    by the caller)."""
    data, priority, attempts, stalled_count, stalls, note = row
    found = list(problems)
    if note is not None:
        if type(note) is str and note.startswith(DAMAGE_NOTE):
            found.append(note[len(DAMAGE_NOTE) :])
        else:
            found.append(f"note: {describe(note)}, set on a job that is not failed")
    return ClaimedJob(
        id=job_id,
        data=_data(data, found),
        lease=Lease(job_id, token),
        priority=priority if type(priority) is int else 0,
        attempts=_count("attempts", attempts, found),
        stalled_count=_count("stalled_count", stalled_count, found),
        stalls=_stalls(stalls, found),
        started=started,
        damage="; ".join(found) if found else None,
    )


def unreadable_report(pk: int) -> ClaimedJob:
    """The report of a claim whose row had no id (moved to the quarantine): an empty token
    (see :attr:`~durable_trio.brokers.ClaimedJob.damage`)."""
    shown = f"<row {pk}>"
    return ClaimedJob(id=shown, data=b"", lease=Lease(shown, ""), damage=QUARANTINE_REASON)


def read_failed(row: Sequence[object]) -> FailedJob:
    """A failed row as stored, every field checked: what cannot be read is named at the end of
    ``error``. ``row``: (id, data, error, failed_at, attempts, stalled_count, stalls, ckey),
    ckey the job's concurrency key (``''``: none; advisory, never damage)."""
    raw_id, data, error, failed_at, attempts, stalled_count, stalls, ckey = row
    problems: list[str] = []
    if type(raw_id) is not str:
        problems.append(f"id: {describe(raw_id)}, not a job id")
    if type(error) is not str:
        problems.append(f"error: {describe(error)}, not text")
    at = 0.0
    if type(failed_at) is float and math.isfinite(failed_at):
        at = failed_at
    else:
        problems.append(f"failed_at: {describe(failed_at)}, not a time")
    read = FailedJob(
        id=raw_id if type(raw_id) is str else "",
        data=_data(data, problems),
        error=error if type(error) is str else "",
        failed_at=at,
        attempts=_count("attempts", attempts, problems),
        stalled_count=_count("stalled_count", stalled_count, problems),
        stalls=_stalls(stalls, problems),
        key=ckey if type(ckey) is str and ckey else None,
    )
    unnamed = [problem for problem in problems if problem not in read.error]
    if not unnamed:
        return read
    return attrs.evolve(read, error=f"{read.error} [unreadable: {'; '.join(unnamed)}]".lstrip())
