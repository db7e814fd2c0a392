"""The SQLite broker's operations: the SQL of push, claim, complete, fail, retry, renew,
recover and the inspection calls, each a plain function of its arguments and a connection.

Each runs in the connection thread inside the one transaction that
:meth:`~durable_trio._sqlite.ConnectionThread.call` opened for it (``BEGIN IMMEDIATE`` for
writes), so it is all or nothing; it never commits, never sleeps and never raises for a stored
value it cannot read (``_rows.py`` turns those into damage). The clock is ``time.time()``, read
inside the transaction.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import TYPE_CHECKING, Final

import attrs

from .._contract import (
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
from ._rows import (
    DELETE_ROW,
    as_bytes,
    describe,
    fetch,
    read_failed,
    read_job,
    readable_id,
    stalls_json,
)

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Sequence

#: Due delayed jobs promoted per pop at most, so one pop never does unbounded work.
PROMOTE_BATCH: Final = 256

_NEXT_SEQ: Final = "UPDATE dt_meta SET value = value + ?1 WHERE name = 'seq' RETURNING value"

_INSERT: Final = """
    INSERT INTO dt_jobs (queue, id, data, priority, seq, state, due_at, pushed_at, ckey)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
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

# A delayed row whose due_at is not a number is promoted as damaged (see _rows.DAMAGE_NOTE):
# the unreadable due_at itself is about to be overwritten, so its value is kept in the note.
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

# A fleet-wide limit (``SupportsQueueLimits``) counts the live claims, never a stored counter.
# Every statement below runs in the claim's write transaction (SQLite has one writer at a
# time), so the count it reads is the count it claims against: exact for any number of
# processes. The active rows of one queue are bounded by the fleet's concurrency; they are
# read off ``dt_jobs_active`` (queue, claimed_at).
_LIMIT: Final = "SELECT lim, per_key FROM dt_limits WHERE queue = ?1"

_ACTIVE_COUNT: Final = "SELECT count(*) FROM dt_jobs WHERE state = 'active' AND queue = ?1"

# The full keys: those with a key off ``dt_jobs_active_key`` (in key order, no sort), and
# ``""`` (the jobs without a key) off ``dt_jobs_active``.
_FULL_KEYS: Final = """
    SELECT ckey FROM dt_jobs INDEXED BY dt_jobs_active_key
    WHERE state = 'active' AND queue = ?1 AND ckey != ''
    GROUP BY ckey HAVING count(*) >= ?2
    UNION ALL
    SELECT '' WHERE (
        SELECT count(*) FROM dt_jobs WHERE state = 'active' AND queue = ?1 AND ckey = ''
    ) >= ?2
"""

# _CLAIM_NEXT on a per-key queue: the first ready job whose key has a free slot (the jobs of
# full keys are skipped, in order, so other keys behind them are still claimed).
_CLAIM_NEXT_KEYED: Final = _CLAIM_NEXT.replace(
    "ORDER BY priority, seq LIMIT 1",
    f"AND ckey NOT IN ({_FULL_KEYS.replace('?1', '?4').replace('?2', '?5')})\n"
    "        ORDER BY priority, seq LIMIT 1",
)

_CLAIMABLE_KEYED: Final = f"""
    SELECT EXISTS (
        SELECT 1 FROM dt_jobs WHERE state = 'ready' AND queue = ?1
            AND ckey NOT IN ({_FULL_KEYS})
    )
"""

_SET_LIMIT: Final = """
    INSERT INTO dt_limits (queue, lim, per_key) VALUES (?1, ?2, ?3)
    ON CONFLICT (queue) DO UPDATE SET lim = excluded.lim, per_key = excluded.per_key
"""

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


def _next_seq(db: sqlite3.Connection, count: int = 1) -> int:
    """Reserve ``count`` sequence numbers; returns the first. One counter for the whole file."""
    ((last,),) = db.execute(_NEXT_SEQ, (count,)).fetchall()
    return int(last) - count + 1


def limit_of(db: sqlite3.Connection, queue: str) -> tuple[int, bool] | None:
    """``queue``'s fleet-wide limit and whether it holds per key (``None``: no limit)."""
    rows = db.execute(_LIMIT, (queue,)).fetchall()
    return (int(rows[0][0]), bool(rows[0][1])) if rows else None


def set_limit(queue: str, limit: int | None, per_key: bool, db: sqlite3.Connection) -> None:
    if limit is None:
        db.execute("DELETE FROM dt_limits WHERE queue = ?1", (queue,))
    else:
        db.execute(_SET_LIMIT, (queue, limit, int(per_key)))


def _claimable(db: sqlite3.Connection, queue: str, limit: tuple[int, bool]) -> bool:
    """Whether a ready job of the limited ``queue`` fits (its queue's or key's limit)."""
    lim, per_key = limit
    if per_key:
        ((found,),) = db.execute(_CLAIMABLE_KEYED, (queue, lim)).fetchall()
        return bool(found)
    ((active,),) = db.execute(_ACTIVE_COUNT, (queue,)).fetchall()
    return int(active) < lim


def probe_one(db: sqlite3.Connection, queue: str, now: float) -> tuple[bool, float | None]:
    ((has_ready, due, due_unreadable),) = fetch(db, _PROBE, (queue,))
    if has_ready:
        # Ready jobs none of which fits its limit are no work: the waiter waits for a slot.
        limit = limit_of(db, queue)
        if limit is not None:
            has_ready = _claimable(db, queue, limit)
    due_at = float(due) if type(due) in (int, float) else None
    # A due_at that is not a number counts as due: the next pop promotes it (as damaged).
    ready = bool(has_ready) or bool(due_unreadable) or (due_at is not None and due_at <= now)
    return ready, due_at


def data_version(db: sqlite3.Connection) -> int:
    ((version,),) = db.execute("PRAGMA data_version").fetchall()
    return int(version)


def push(queue: str, job: Job, priority: int, delay: float, db: sqlite3.Connection) -> None:
    seq = _next_seq(db)
    now = time.time()
    state, due_at = ("delayed", now + delay) if delay > 0 else ("ready", None)
    db.execute(_INSERT, (queue, job.id, job.data, priority, seq, state, due_at, now, job.key or ""))


def _promote_due(db: sqlite3.Connection, queue: str, now: float) -> None:
    due = db.execute(_DUE_DELAYED, (queue, now, PROMOTE_BATCH)).fetchall()
    if due:
        first = _next_seq(db, len(due))
        promote = [(first + i, pk) for i, (pk, unreadable) in enumerate(due) if not unreadable]
        damaged = [(first + i, pk) for i, (pk, unreadable) in enumerate(due) if unreadable]
        db.executemany(_PROMOTE, promote)
        if damaged:
            db.executemany(_PROMOTE_DAMAGED, damaged)


def _claim_next(
    db: sqlite3.Connection, queue: str, worker: str, now: float, per_key: int = 0
) -> ClaimedJob | None:
    """Claim the next ready job (with ``per_key``, the limit per key: the next whose key has
    a free slot)."""
    token = secrets.token_hex(8)
    if per_key:
        rows = fetch(db, _CLAIM_NEXT_KEYED, (token, now, worker, queue, per_key))
    else:
        rows = fetch(db, _CLAIM_NEXT, (token, now, worker, queue))
    if not rows:
        return None
    ((pk, raw_id, *fields, note, started),) = rows
    job_id, problems, report = readable_id(db, pk, raw_id, now)
    if job_id is None:
        return report
    # (a suspect, stalled before, is stored not started, like a claim popped ahead)
    return read_job(job_id, token, fields, note, problems, started=bool(started))


def pop(queue: str, worker: str, db: sqlite3.Connection) -> ClaimedJob | None:
    claimed = pop_many(queue, 1, worker, db)
    return claimed[0] if claimed else None


def pop_many(
    queue: str, count: int, worker: str, db: sqlite3.Connection, ahead: int = 0
) -> list[ClaimedJob]:
    now = time.time()
    _promote_due(db, queue, now)
    claimed: list[ClaimedJob] = []
    total = count + ahead
    per_key = 0
    limit = limit_of(db, queue)
    if limit is not None:
        lim, keyed = limit
        if keyed:
            per_key = lim
        else:
            ((active,),) = db.execute(_ACTIVE_COUNT, (queue,)).fetchall()
            total = min(total, lim - int(active))
    while len(claimed) < total:
        # The claims past ``count`` are popped ahead: not started (the marked worker).
        marked = worker if len(claimed) < count else _AHEAD + worker
        job = _claim_next(db, queue, marked, now, per_key)
        if job is None:
            break
        claimed.append(job)
    return claimed


def mark_started(queue: str, leases: Sequence[Lease], db: sqlite3.Connection) -> list[bool]:
    now = time.time()
    return [
        db.execute(_MARK_STARTED, (lease.token, queue, lease.job_id, now)).rowcount == 1
        for lease in leases
    ]


def complete_many(leases: Sequence[Lease], queue: str, db: sqlite3.Connection) -> list[bool]:
    return [complete(lease, queue, db) for lease in leases]


def push_many(queue: str, pairs: list[tuple[Job, int | None]], db: sqlite3.Connection) -> None:
    for job, priority in pairs:
        push(queue, job, priority or 0, 0.0, db)


def complete(lease: Lease, queue: str, db: sqlite3.Connection) -> bool:
    return db.execute(_COMPLETE, (lease.token, queue, lease.job_id)).rowcount == 1


def fail_and_push(
    lease: Lease,
    queue: str,
    error: str,
    retention: int,
    push_queue: str,
    job: Job,
    db: sqlite3.Connection,
) -> bool:
    if not fail(lease, queue, error, retention, db):
        return False
    push(push_queue, job, 0, 0.0, db)
    return True


def fail(lease: Lease, queue: str, error: str, retention: int, db: sqlite3.Connection) -> bool:
    seq = _next_seq(db)
    params = (lease.token, queue, lease.job_id, error, time.time(), seq)
    if db.execute(_FAIL, params).rowcount != 1:
        return False
    db.execute(_PRUNE_FAILED, (queue, retention))
    return True


def retry(
    lease: Lease, queue: str, delay: float, count_attempt: bool, db: sqlite3.Connection
) -> bool:
    # An immediate, attempt-neutral handback keeps the job's place in its queue (NULL: keep
    # the sequence); a retry goes to the back.
    keep_place = delay <= 0 and not count_attempt
    seq = None if keep_place else _next_seq(db)
    state, due_at = ("delayed", time.time() + delay) if delay > 0 else ("ready", None)
    params = (lease.token, queue, lease.job_id, state, due_at, seq, int(count_attempt))
    return db.execute(_RETRY, params).rowcount == 1


def renew(queue: str, leases: Sequence[Lease], db: sqlite3.Connection) -> RenewOutcome:
    now = time.time()
    lost: list[Lease] = []
    renewed = 0
    for lease in leases:
        if db.execute(_RENEW, (lease.token, queue, lease.job_id, now)).rowcount == 1:
            renewed += 1
        else:
            lost.append(lease)
    return RenewOutcome(renewed=renewed, lost=tuple(lost))


def recover(queue: str, threshold: float, max_stalled: int, db: sqlite3.Connection) -> Recovery:
    now = time.time()
    rows = fetch(db, _STALLED, (queue, now - threshold))
    recovered = 0
    exceeded: list[ClaimedJob] = []
    for pk, raw_id, *fields, worker, claimed_at, note in rows:
        job_id, problems, report = readable_id(db, pk, raw_id, now)
        if job_id is None:
            assert report is not None
            exceeded.append(report)
            continue
        if not isinstance(claimed_at, (int, float)) or not math.isfinite(claimed_at):
            problems.append(f"claimed_at: {describe(claimed_at)}, not a time")
        if type(worker) is not str:
            problems.append(f"worker: {describe(worker)}, not TEXT")
        token = secrets.token_hex(8)
        job = read_job(job_id, token, fields, note, problems)
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
            db.execute(_RELEASE_POISON, (token, now, stalled_count, stalls_json(stalls), pk))
            exceeded.append(attrs.evolve(job, stalled_count=stalled_count, stalls=stalls))
        else:
            # A reclaimed job keeps its place: it waited its turn once already.
            db.execute(_REQUEUE_STALLED, (stalled_count, stalls_json(stalls), pk))
            recovered += 1
    return Recovery(recovered=recovered, exceeded=tuple(exceeded))


def size(queue: str, db: sqlite3.Connection) -> int:
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


def job_state(queue: str, job_id: str, db: sqlite3.Connection) -> JobState | None:
    rows = db.execute(_JOB_STATE, (queue, job_id)).fetchall()
    if not rows:
        return None
    claimed, worker = rows[0]
    if claimed:
        return JobState(claimed=True, worker=worker if isinstance(worker, str) else "")
    return JobState(claimed=False)


def job_states(
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


def waiting_queues(prefix: str, db: sqlite3.Connection) -> list[str]:
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


def requeue_failed(
    queue: str, job_id: str, priority: int | None, db: sqlite3.Connection
) -> bool:
    row = db.execute(_NEWEST_FAILED, (queue, job_id)).fetchone()
    if row is None:
        return False
    db.execute(_REQUEUE_FAILED, (row[0], _next_seq(db), priority, time.time()))
    return True


def delete_failed(queue: str, job_id: str, db: sqlite3.Connection) -> bool:
    row = db.execute(_NEWEST_FAILED, (queue, job_id)).fetchone()
    if row is None:
        return False
    db.execute(DELETE_ROW, (row[0],))
    return True


def queue_stats(queue: str, db: sqlite3.Connection) -> QueueStats:
    now = time.time()
    ((ready, oldest, unknown, delayed, active, failed),) = fetch(db, _STATS, (queue,))
    age = None
    if ready and not unknown and isinstance(oldest, (int, float)):
        age = max(0.0, now - oldest)
    limit = limit_of(db, queue)
    return QueueStats(
        int(ready),
        int(delayed),
        int(active),
        int(failed),
        age,
        None if limit is None else limit[0],
        limit is not None and limit[1],
    )


def known_queues(prefix: str, db: sqlite3.Connection) -> list[str]:
    bounds = (prefix, prefix + "\U0010ffff")  # every name that starts with the prefix
    statements = (_READY_QUEUES, _DELAYED_QUEUES, _ACTIVE_QUEUES, _FAILED_QUEUES)
    return sorted({str(q) for sql in statements for (q,) in db.execute(sql, bounds)})


def failed_jobs(queue: str, limit: int, db: sqlite3.Connection) -> list[FailedJob]:
    return [read_failed(row) for row in fetch(db, _FAILED_JOBS, (queue, limit))]


def quarantined(queue: str, limit: int, db: sqlite3.Connection) -> list[QuarantinedEntry]:
    return [
        QuarantinedEntry(
            queue=queue,
            reason=as_bytes(reason).decode("utf-8", "replace"),
            raw=as_bytes(raw),
            at=float(at) if isinstance(at, (int, float)) else 0.0,
        )
        for reason, raw, at in fetch(db, _QUARANTINED, (queue, limit))
    ]


def probe(queue: str, db: sqlite3.Connection) -> tuple[bool, float | None, int, bool]:
    """(work ready, earliest due time, data version, whether ``queue`` has a limit)."""
    # The version is read first: a commit the probe does not see changes it afterwards.
    version = data_version(db)
    ready, due = probe_one(db, queue, time.time())
    return ready, due, version, limit_of(db, queue) is not None
