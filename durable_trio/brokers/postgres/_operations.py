"""The PostgreSQL broker's operations: the SQL of push, claim, complete, fail, retry, renew,
recover and the inspection calls, each an async function of a pool (or of one connection in a
transaction) and its arguments.

Each call is one round trip where it can be: a statement, or a pipeline of them
(:meth:`~durable_trio._postgres.PgPool.pipeline`, one implicit transaction: all or nothing).
Claims lock their rows with ``FOR UPDATE SKIP LOCKED`` on the ready rows' partial index, so
consumers never wait on each other's claims; lease checks go through the active rows' token
index. The clock is the server's (``now()``, the transaction's start), in epoch seconds.
Nothing stored makes an operation raise: ``_rows.py`` turns what cannot be read into damage,
and a row without an id is moved to the quarantine.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
from typing import TYPE_CHECKING, Any, Final

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
    QUARANTINE_REASON,
    describe,
    read_failed,
    read_job,
    stalls_json,
    unreadable_report,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..._postgres import PgConnection, PgPool, Result

__all__ = ["PROMOTE_BATCH", "RECOVER_BATCH", "UNBOUNDED", "Operations", "lock_key"]

#: Due delayed jobs promoted per pop at most, so one pop never does unbounded work.
PROMOTE_BATCH: Final = 256

#: Stalled claims handled per transaction of a sweep (a sweep runs as many as it needs).
RECOVER_BATCH: Final = 500

#: The ``command_timeout`` of every statement a broker call sends: no timeout scope of the
#: statement's own. Each call runs them in one shielded scope bounded by its ``call_timeout``
#: (``PostgresBroker._call``), which bounds every statement too (one scope per call, not one
#: more per statement: entering and leaving one is ~10 us of CPU, a fifth of a round trip's).
#: A call past its bound is cancelled like a timed-out statement: the connection is made safe
#: or closed, and the call raises ``BrokerUnavailable`` (it may have run). Only for
#: statements run inside ``_call``.
UNBOUNDED: Final = math.inf

#: The server's clock, epoch seconds (the transaction's start: one time per call).
_NOW: Final = "extract(epoch FROM now())::float8"

_INSERT: Final = f"""
    INSERT INTO {{s}}.broker_jobs (queue, id, data, priority, state, due_at, pushed_at, ckey)
    VALUES ($1, $2, $3, $4,
        CASE WHEN $5::float8 > 0 THEN 'delayed' ELSE 'ready' END,
        CASE WHEN $5::float8 > 0 THEN {_NOW} + $5::float8 END, {_NOW}, $6)
"""

_INSERT_MANY: Final = f"""
    INSERT INTO {{s}}.broker_jobs (queue, id, data, priority, state, pushed_at, ckey)
    SELECT $1, u.id, u.data, u.priority, 'ready', {_NOW}, u.ckey
    FROM unnest($2::text[], $3::bytea[], $4::bigint[], $5::text[])
        WITH ORDINALITY AS u(id, data, priority, ckey, n)
    ORDER BY u.n
"""

_NOTIFY: Final = "SELECT pg_notify($1, $2)"

# _INSERT_MANY and its NOTIFY ($6) in one statement: one statement fewer in a finish-and-claim
# (its data-modifying CTE runs to its end whatever the outer query reads).
_INSERT_MANY_RING: Final = f"""
    WITH pushed AS ({_INSERT_MANY.rstrip()}
        RETURNING 1)
    SELECT pg_notify($6, '')
"""

# A delayed row whose due_at is not a finite time would never come due (NaN sorts after
# Infinity): promoted at once, marked as damaged.
#
# On a limited queue (a row in broker_limits) the same statement first takes the queue's
# transaction-scoped advisory lock ($2, see ``lock_key``), held until the claim's transaction
# ends: the claim statement after it, whose READ COMMITTED snapshot is taken once the lock is
# held, counts every claim committed before and none can be made beside it, so the count is
# exact for any number of claimers. An unlimited queue's claim takes no lock (the lookup of
# its limit is one primary-key probe inside this statement).
_PROMOTE: Final = f"""
    WITH locked AS (
        SELECT pg_advisory_xact_lock($2::bigint) FROM {{s}}.broker_limits WHERE queue = $1
    ), promoted AS (
    UPDATE {{s}}.broker_jobs AS j
    SET state = 'ready', due_at = NULL, seq = nextval('{{s}}.broker_seq'),
        note = CASE WHEN j.due_at >= 'Infinity'::float8 OR j.due_at = '-Infinity'::float8
            THEN 'damaged: due_at: ' || j.due_at::text || ', not a time' ELSE j.note END
    FROM (
        SELECT pk FROM {{s}}.broker_jobs
        WHERE state = 'delayed' AND queue = $1
            AND (due_at <= {_NOW} OR due_at >= 'Infinity'::float8)
        ORDER BY due_at LIMIT {PROMOTE_BATCH}
        FOR UPDATE SKIP LOCKED
    ) AS due
    WHERE j.pk = due.pk
    RETURNING j.pk
    )
    SELECT (SELECT count(*) FROM locked), (SELECT count(*) FROM promoted)
"""

# A fleet-wide limit (``SupportsQueueLimits``) counts the live claims, never a stored counter:
# ``lim``, the queue's limit (no row: none); ``held``, on a per-key queue only, its claims per
# key (the keyed ones off broker_jobs_active_key, ``''`` off broker_jobs_active). Both are
# gated on the limit's row (a one-time filter), so an unlimited queue reads nothing more.
_LIMIT_CTES: Final = """
    lim AS (SELECT lim, per_key FROM {s}.broker_limits WHERE queue = $1),
    held AS (
        SELECT ckey, count(*) AS n FROM {s}.broker_jobs
        WHERE state = 'active' AND queue = $1 AND ckey <> '' AND (SELECT per_key FROM lim)
        GROUP BY ckey
        UNION ALL
        SELECT '' COLLATE "C", count(*) FROM {s}.broker_jobs
        WHERE state = 'active' AND queue = $1 AND ckey = '' AND (SELECT per_key FROM lim)
    )
"""

#: A ready row whose key has a free slot (every row but on a per-key queue).
_KEY_NOT_FULL: Final = "ckey NOT IN (SELECT ckey FROM held WHERE n >= (SELECT lim FROM lim))"

#: The free slots of a whole-queue limit; NULL for none (or a limit per key).
_QUEUE_FREE: Final = """(
    SELECT greatest(0, lim - (
        SELECT count(*) FROM {s}.broker_jobs WHERE state = 'active' AND queue = $1
    )) FROM lim WHERE NOT per_key
)"""


# $2 claims; the first $5 of them started (the rest popped ahead), a suspect (stalled before)
# never. Tokens: the call's random prefix and the claim's place in it. The claim of a queue
# without a limit: it claims nothing on a queue that has one (a one-time filter on
# broker_limits' primary key), and its caller then claims again with _CLAIM_LIMITED (see
# ``Operations.limited``).
_CLAIM: Final = f"""
    WITH picked AS (
        SELECT pk, priority, seq FROM {{s}}.broker_jobs
        WHERE state = 'ready' AND queue = $1
            AND NOT EXISTS (SELECT FROM {{s}}.broker_limits WHERE queue = $1)
        ORDER BY priority, seq LIMIT $2
        FOR UPDATE SKIP LOCKED
    ), numbered AS (
        SELECT pk, row_number() OVER (ORDER BY priority, seq) AS n FROM picked
    )
    UPDATE {{s}}.broker_jobs AS j
    SET state = 'active', token = $3 || numbered.n::text, claimed_at = {_NOW}, worker = $4,
        started = numbered.n <= $5 AND j.stalled_count <= 0
    FROM numbered WHERE j.pk = numbered.pk
    RETURNING numbered.n, j.pk, j.id, j.token, j.data, j.priority, j.attempts, j.stalled_count,
        j.stalls, j.note, j.started
"""

# _CLAIM of one job, ``LIMIT 1`` written out ($2 gone, the others one lower): its generic plan
# is as cheap as a custom one, so the server plans it once per connection. With ``LIMIT $2`` the
# generic plan expects a tenth of the table and joins it back by a hash join over the whole
# table, so PostgreSQL plans _CLAIM at every execution (~0.2 ms of the server's CPU, more than
# the claim's own execution: docs/decisions.md, issue 32).
_CLAIM_ONE: Final = (
    _CLAIM.replace("LIMIT $2", "LIMIT 1")
    .replace("$3", "$2")
    .replace("$4", "$3")
    .replace("$5", "$4")
)

# The claim of a limited queue (under its lock, see _PROMOTE; right for any queue): no more
# than its free slots (none: no row is even read); per
# key, the rows of full keys are skipped (the rows behind them still claimed, in order), and of
# the rows picked a key keeps as many as it has free slots (the others stay ready: the pop may
# then hand out fewer than fit, and ``wait_for_work`` answers at once for the rest). ``LIMIT
# $2`` stays a plain parameter: the planner then expects a few rows, and joins them back to
# the table by its primary key.
_CLAIM_LIMITED: Final = f"""
    WITH {_LIMIT_CTES}, picked AS (
        SELECT pk, priority, seq, ckey FROM {{s}}.broker_jobs
        WHERE state = 'ready' AND queue = $1 AND {_KEY_NOT_FULL}
            AND coalesce({_QUEUE_FREE}, 1) > 0
        ORDER BY priority, seq LIMIT $2
        FOR UPDATE SKIP LOCKED
    ), ranked AS (
        SELECT pk, priority, seq, ckey,
            row_number() OVER (PARTITION BY ckey ORDER BY priority, seq) AS r
        FROM picked
    ), fitting AS (
        SELECT k.pk, k.priority, k.seq
        FROM ranked AS k LEFT JOIN held AS h ON h.ckey = k.ckey
        WHERE NOT coalesce((SELECT per_key FROM lim), false)
            OR k.r <= (SELECT lim FROM lim) - coalesce(h.n, 0)
    ), numbered AS (
        SELECT pk, row_number() OVER (ORDER BY priority, seq) AS n FROM fitting
    )
    UPDATE {{s}}.broker_jobs AS j
    SET state = 'active', token = $3 || numbered.n::text, claimed_at = {_NOW}, worker = $4,
        started = numbered.n <= $5 AND j.stalled_count <= 0
    FROM numbered WHERE j.pk = numbered.pk AND numbered.n <= coalesce({_QUEUE_FREE}, $2)
    RETURNING numbered.n, j.pk, j.id, j.token, j.data, j.priority, j.attempts, j.stalled_count,
        j.stalls, j.note, j.started
"""

# A lease that ends on a limited queue frees a slot: ``NOTIFY`` its channel ($N), so a waiter
# at the limit looks again. The notification is a scalar subquery of the answer's rows: run
# once, only when a lease ended, and only for a queue with a limit (a primary-key probe).
_RING_IF_LIMITED: Final = """
    rung AS (SELECT pg_notify($N, '') FROM {s}.broker_limits WHERE queue = $1)
"""

_COMPLETE: Final = f"""
    WITH gone AS (
        DELETE FROM {{s}}.broker_jobs AS j USING unnest($2::text[], $3::text[]) AS l(token, id)
        WHERE j.state = 'active' AND j.token = l.token AND j.queue = $1 AND j.id = l.id
        RETURNING j.token
    ), {_RING_IF_LIMITED.replace("$N", "$4")}
    SELECT token, (SELECT count(*) FROM rung) FROM gone
"""

_FAIL: Final = f"""
    WITH gone AS (
        DELETE FROM {{s}}.broker_jobs
        WHERE state = 'active' AND token = $2 AND queue = $1 AND id = $3
        RETURNING queue, id, data, priority, attempts, stalled_count, stalls, pushed_at, ckey
    ), failed AS (
        INSERT INTO {{s}}.broker_failed (queue, id, data, priority, error, failed_at, attempts,
            stalled_count, stalls, pushed_at, ckey)
        SELECT queue, id, data, priority, $4, {_NOW}, attempts, stalled_count, stalls,
            pushed_at, ckey
        FROM gone
        RETURNING pk
    ), {_RING_IF_LIMITED.replace("$N", "$5")}
    SELECT pk, (SELECT count(*) FROM rung) FROM failed
"""

# fail, then (only if the lease held) push $6/$7 (key $8) onto $5: one statement, both or
# neither; $9 the failed queue's channel (rung if it has a limit).
_FAIL_AND_PUSH: Final = f"""
    WITH gone AS (
        DELETE FROM {{s}}.broker_jobs
        WHERE state = 'active' AND token = $2 AND queue = $1 AND id = $3
        RETURNING queue, id, data, priority, attempts, stalled_count, stalls, pushed_at, ckey
    ), failed AS (
        INSERT INTO {{s}}.broker_failed (queue, id, data, priority, error, failed_at, attempts,
            stalled_count, stalls, pushed_at, ckey)
        SELECT queue, id, data, priority, $4, {_NOW}, attempts, stalled_count, stalls,
            pushed_at, ckey
        FROM gone
        RETURNING pk
    ), pushed AS (
        INSERT INTO {{s}}.broker_jobs (queue, id, data, priority, state, pushed_at, ckey)
        SELECT $5, $6, $7, 0, 'ready', {_NOW}, $8 FROM failed
        RETURNING pk
    ), {_RING_IF_LIMITED.replace("$N", "$9")}
    SELECT pk, (SELECT count(*) FROM rung) FROM pushed
"""

_PRUNE_FAILED: Final = """
    DELETE FROM {s}.broker_failed
    WHERE queue = $1 AND pk <= (
        SELECT pk FROM {s}.broker_failed WHERE queue = $1 ORDER BY pk DESC OFFSET $2 LIMIT 1
    )
"""

# An immediate, attempt-neutral handback ($5) keeps the job's place; a retry goes to the back.
_RETRY: Final = f"""
    UPDATE {{s}}.broker_jobs
    SET state = CASE WHEN $4::float8 > 0 THEN 'delayed' ELSE 'ready' END,
        due_at = CASE WHEN $4::float8 > 0 THEN {_NOW} + $4::float8 END,
        seq = CASE WHEN $5::bool THEN seq ELSE nextval('{{s}}.broker_seq') END,
        attempts = attempts + $6::bigint, token = NULL, claimed_at = NULL, started = true
    WHERE state = 'active' AND token = $2 AND queue = $1 AND id = $3
"""

_MARK_STARTED: Final = f"""
    UPDATE {{s}}.broker_jobs AS j SET started = true, claimed_at = {_NOW}
    FROM unnest($2::text[], $3::text[]) AS l(token, id)
    WHERE j.state = 'active' AND j.token = l.token AND j.queue = $1 AND j.id = l.id
    RETURNING j.token
"""

_RENEW: Final = f"""
    UPDATE {{s}}.broker_jobs AS j SET claimed_at = {_NOW}
    FROM unnest($2::text[], $3::text[]) AS l(token, id)
    WHERE j.state = 'active' AND j.token = l.token AND j.queue = $1 AND j.id = l.id
    RETURNING j.token
"""

# Claims older than the threshold, and those whose claimed_at would never look old enough
# (infinite or NaN: a claim is always stamped with a finite time), oldest first.
_STALLED: Final = f"""
    SELECT pk, id, data, priority, attempts, stalled_count, stalls, note, worker, started,
        claimed_at
    FROM {{s}}.broker_jobs
    WHERE state = 'active' AND queue = $1
        AND (claimed_at < {_NOW} - $2::float8 OR claimed_at >= 'Infinity'::float8)
    ORDER BY claimed_at LIMIT {RECOVER_BATCH}
    FOR UPDATE SKIP LOCKED
"""

_REQUEUE_STALLED: Final = """
    UPDATE {s}.broker_jobs AS j
    SET state = 'ready', token = NULL, claimed_at = NULL, started = true,
        stalled_count = u.stalled_count, stalls = u.stalls
    FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS u(pk, stalled_count, stalls)
    WHERE j.pk = u.pk
"""

# Re-leased to the sweep (poison, or damaged: then count and history stay as found).
_RELEASE: Final = f"""
    UPDATE {{s}}.broker_jobs AS j
    SET token = u.token, claimed_at = {_NOW},
        stalled_count = coalesce(u.stalled_count, j.stalled_count),
        stalls = coalesce(u.stalls, j.stalls)
    FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[])
        AS u(pk, token, stalled_count, stalls)
    WHERE j.pk = u.pk
"""

# Rows without an id, moved whole: every field rendered for a person, then data as stored.
_QUARANTINE: Final = f"""
    WITH gone AS (
        DELETE FROM {{s}}.broker_jobs WHERE pk = ANY($1::bigint[]) AND id IS NULL
        RETURNING *
    )
    INSERT INTO {{s}}.broker_quarantine (queue, reason, raw, at)
    SELECT queue, $2, convert_to(
        'id=NULL priority=' || priority || ' state=' || state || ' attempts=' || attempts
        || ' stalled_count=' || stalled_count || ' stalls=' || quote_literal(stalls)
        || ' worker=' || quote_literal(worker) || ' note=' || quote_nullable(note) || ' data=',
        'UTF8') || coalesce(data, 'NULL'::bytea), {_NOW}
    FROM gone
"""

_SET_LIMIT: Final = """
    INSERT INTO {s}.broker_limits (queue, lim, per_key) VALUES ($1, $2, $3)
    ON CONFLICT (queue) DO UPDATE SET lim = excluded.lim, per_key = excluded.per_key
"""

_DELETE_LIMIT: Final = "DELETE FROM {s}.broker_limits WHERE queue = $1"

_QUARANTINED: Final = """
    SELECT reason, raw, at FROM {s}.broker_quarantine WHERE queue = $1 ORDER BY pk DESC LIMIT $2
"""

_SIZE: Final = """
    SELECT (SELECT count(*) FROM {s}.broker_jobs WHERE state = 'ready' AND queue = $1)
         + (SELECT count(*) FROM {s}.broker_jobs WHERE state = 'delayed' AND queue = $1)
"""

_FAILED_JOBS: Final = """
    SELECT id, data, error, failed_at, attempts, stalled_count, stalls, ckey
    FROM {s}.broker_failed WHERE queue = $1 ORDER BY pk DESC LIMIT $2
"""

_NEWEST_FAILED: Final = """
    SELECT pk FROM {s}.broker_failed WHERE queue = $1 AND id = $2 ORDER BY pk DESC LIMIT 1
"""

_REQUEUE_FAILED: Final = f"""
    WITH gone AS (
        DELETE FROM {{s}}.broker_failed WHERE pk = ({_NEWEST_FAILED})
        RETURNING queue, id, data, priority, ckey
    )
    INSERT INTO {{s}}.broker_jobs (queue, id, data, priority, state, pushed_at, ckey)
    SELECT queue, id, data, coalesce($3::bigint, priority), 'ready', {_NOW}, ckey FROM gone
    RETURNING pk
"""

_DELETE_FAILED: Final = (
    f"DELETE FROM {{s}}.broker_failed WHERE pk = ({_NEWEST_FAILED}) RETURNING pk"
)

# Each count on its state's partial index, in one statement (one snapshot). The oldest ready
# age is unknown while a ready row has no finite push time (written by someone else).
_STATS: Final = f"""
    SELECT r.n, r.oldest, r.unknown,
        (SELECT count(*) FROM {{s}}.broker_jobs WHERE state = 'delayed' AND queue = $1),
        (SELECT count(*) FROM {{s}}.broker_jobs WHERE state = 'active' AND queue = $1),
        (SELECT count(*) FROM {{s}}.broker_failed WHERE queue = $1),
        {_NOW}, l.lim, coalesce(l.per_key, false)
    FROM (
        SELECT count(*) AS n, min(pushed_at) AS oldest,
            count(*) FILTER (WHERE pushed_at IS NULL OR pushed_at IN
                ('Infinity', '-Infinity', 'NaN')) AS unknown
        FROM {{s}}.broker_jobs WHERE state = 'ready' AND queue = $1
    ) AS r LEFT JOIN {{s}}.broker_limits AS l ON l.queue = $1
"""

_WAITING_QUEUES: Final = """
    SELECT DISTINCT queue FROM {s}.broker_jobs
    WHERE state IN ('ready', 'delayed') AND starts_with(queue, $1)
"""

_KNOWN_QUEUES: Final = """
    SELECT DISTINCT queue FROM {s}.broker_jobs WHERE starts_with(queue, $1)
    UNION
    SELECT DISTINCT queue FROM {s}.broker_failed WHERE starts_with(queue, $1)
"""

_QUEUES_WITH_CLAIMS: Final = """
    SELECT DISTINCT queue FROM {s}.broker_jobs WHERE state = 'active' AND queue = ANY($1::text[])
"""

_JOB_STATES: Final = """
    SELECT id, state = 'active', worker FROM {s}.broker_jobs
    WHERE state IN ('ready', 'delayed', 'active') AND queue = $1 AND id = ANY($2::text[])
"""

# Whether a job is ready (or a delayed one due, or one whose due_at is not a time: the next
# pop promotes it), the earliest due time, and the server's clock. On a limited queue, ready
# jobs none of which fits (the queue, or every ready job's key, at its limit) are no work.
_PROBE: Final = f"""
    WITH {_LIMIT_CTES}
    SELECT EXISTS (
            SELECT 1 FROM {{s}}.broker_jobs WHERE state = 'ready' AND queue = $1
                AND {_KEY_NOT_FULL}
        ) AND coalesce({_QUEUE_FREE}, 1) > 0,
        (SELECT due_at FROM {{s}}.broker_jobs WHERE state = 'delayed' AND queue = $1
            ORDER BY due_at LIMIT 1),
        {_NOW}
"""


@functools.lru_cache(maxsize=1024)  # (a hash per call otherwise: claims, pushes)
def lock_key(schema: str, queue: str) -> int:
    """The key of ``queue``'s advisory lock (``pg_advisory_xact_lock(bigint)``), taken by
    every claim of a limited queue: a hash of schema and queue, so two schemas on one server
    never hold each other's (a collision only makes two queues' claims take turns)."""
    digest = hashlib.blake2b(f"{schema}\x00{queue}".encode(), digest_size=8, person=b"dt-limit")
    return int.from_bytes(digest.digest(), "big", signed=True)


def _arrays(leases: Sequence[Lease]) -> tuple[list[str], list[str]]:
    """The tokens and ids of ``leases`` (the arrays a set-based statement takes)."""
    return [lease.token for lease in leases], [lease.job_id for lease in leases]


def _answers(leases: Sequence[Lease], hit: set[str]) -> list[bool]:
    """Per lease, in order: whether the statement found it (a lease named twice: once)."""
    answers = []
    for lease in leases:
        answers.append(lease.token in hit)
        hit.discard(lease.token)
    return answers


class Operations:
    """The broker's SQL for one schema (formatted once) and the calls that run it.

    Args:
        schema: the quoted schema name (``quote_ident``).
        failed_retention: failed jobs kept per queue (the newest).
    """

    def __init__(self, schema: str, failed_retention: int) -> None:
        self._retention = failed_retention
        self._schema = schema

        def sql(template: str) -> str:
            return template.replace("{s}", schema)

        self.insert = sql(_INSERT)
        self.insert_many_ring = sql(_INSERT_MANY_RING)
        self.promote = sql(_PROMOTE)
        self.claim = sql(_CLAIM)
        self.claim_one = sql(_CLAIM_ONE)
        self.claim_limited = sql(_CLAIM_LIMITED)
        self.limited: set[str] = set()
        """The queues this process last saw with a fleet-wide limit (a hint, never trusted:
        which claim statement to send first; see :meth:`learn`)."""
        self.complete = sql(_COMPLETE)
        self.fail = sql(_FAIL)
        self.fail_and_push = sql(_FAIL_AND_PUSH)
        self.prune_failed = sql(_PRUNE_FAILED)
        self.retry = sql(_RETRY)
        self.mark_started = sql(_MARK_STARTED)
        self.renew = sql(_RENEW)
        self.stalled = sql(_STALLED)
        self.requeue_stalled = sql(_REQUEUE_STALLED)
        self.release = sql(_RELEASE)
        self.quarantine = sql(_QUARANTINE)
        self.quarantined = sql(_QUARANTINED)
        self.size = sql(_SIZE)
        self.failed_jobs = sql(_FAILED_JOBS)
        self.requeue_failed = sql(_REQUEUE_FAILED)
        self.delete_failed = sql(_DELETE_FAILED)
        self.stats = sql(_STATS)
        self.waiting_queues = sql(_WAITING_QUEUES)
        self.known_queues = sql(_KNOWN_QUEUES)
        self.queues_with_claims = sql(_QUEUES_WITH_CLAIMS)
        self.states = sql(_JOB_STATES)
        self.probe = sql(_PROBE)
        self.set_limit = sql(_SET_LIMIT)
        self.delete_limit = sql(_DELETE_LIMIT)

    # -- pieces of pipelines ------------------------------------------------------------------

    def push_statements(
        self, queue: str, job: Job, priority: int, delay: float, channel: str
    ) -> list[tuple[str, Sequence[Any]]]:
        """The insert and its ``NOTIFY`` (payload ``later`` for a delayed job)."""
        payload = "later" if delay > 0 else ""
        return [
            (self.insert, (queue, job.id, job.data, priority, float(delay), job.key or "")),
            (_NOTIFY, (channel, payload)),
        ]

    def push_many_statements(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None], channel: str
    ) -> list[tuple[str, Sequence[Any]]]:
        """One statement: an insert for every job and one ``NOTIFY`` for all of them (none for
        no jobs)."""
        if not jobs:
            return []
        ids = [job.id for job in jobs]
        data = [job.data for job in jobs]
        keys = [job.key or "" for job in jobs]
        priority = [p or 0 for p in priorities]
        return [(self.insert_many_ring, (queue, ids, data, priority, keys, channel))]

    def claim_statements(
        self, queue: str, count: int, worker: str, started: int, limited: bool
    ) -> list[tuple[str, Sequence[Any]]]:
        """Promote due delayed jobs (taking the queue's lock if it has a limit), then claim up
        to ``count`` (the first ``started`` of them started); ``limited``: with the statement
        that counts the queue's claims (else the plain one, which claims nothing on a limited
        queue)."""
        prefix = secrets.token_hex(8) + ":"
        promote = (self.promote, (queue, lock_key(self._schema, queue)))
        if count == 1 and not limited:
            return [promote, (self.claim_one, (queue, prefix, worker, started))]
        claim = self.claim_limited if limited else self.claim
        return [promote, (claim, (queue, count, prefix, worker, started))]

    def learn(self, queue: str, promoted: Result) -> bool:
        """Whether ``queue`` has a limit, as the promote of a claim found it (it took the
        queue's lock), remembered for the next claim's choice of statement. A claim made with
        the plain statement on a queue found limited claimed nothing: its caller claims again
        with the limited one (one more round trip, once per process, after a limit appears;
        a limit removed costs nothing, the limited statement being right for any queue)."""
        limited = bool(promoted.rows and promoted.rows[0][0])
        if limited:
            self.limited.add(queue)
        else:
            self.limited.discard(queue)
        return limited

    async def read_claims(self, pool: PgPool, result: Result) -> list[ClaimedJob]:
        """The claims of a claim statement's ``result``, in pop order; rows without an id are
        moved to the quarantine (one more statement, rare) and reported with an empty token."""
        claimed: list[ClaimedJob] = []
        unreadable: list[int] = []
        for n, pk, job_id, token, *fields, started in sorted(result.rows, key=lambda r: r[0]):
            del n
            if job_id is None:
                unreadable.append(pk)
                claimed.append(unreadable_report(pk))
                continue
            claimed.append(read_job(job_id, token, fields, started=bool(started)))
        if unreadable:
            # Not atomic with the claim: should this fail, the rows stay claimed under a
            # token nobody holds, and the stalled sweep meets them again.
            await pool.execute(
                self.quarantine, unreadable, QUARANTINE_REASON, command_timeout=UNBOUNDED
            )
        return claimed

    # -- calls --------------------------------------------------------------------------------

    async def pop(
        self, pool: PgPool, queue: str, count: int, worker: str, ahead: int = 0
    ) -> list[ClaimedJob]:
        limited = queue in self.limited
        statements = self.claim_statements(queue, count + ahead, worker, count, limited)
        results = await pool.pipeline(statements, command_timeout=UNBOUNDED)
        if self.learn(queue, results[-2]) and not limited:
            statements = self.claim_statements(queue, count + ahead, worker, count, True)
            results = await pool.pipeline(statements, command_timeout=UNBOUNDED)
        return await self.read_claims(pool, results[-1])

    async def complete_many(
        self, pool: PgPool, queue: str, leases: Sequence[Lease], channel: str
    ) -> list[bool]:
        tokens, ids = _arrays(leases)
        rows = await pool.fetch(
            self.complete, queue, tokens, ids, channel, command_timeout=UNBOUNDED
        )
        return _answers(leases, {row[0] for row in rows})

    async def fail_job(
        self, pool: PgPool, queue: str, lease: Lease, error: str, channel: str
    ) -> bool:
        results = await pool.pipeline(
            [
                (self.fail, (queue, lease.token, lease.job_id, error, channel)),
                (self.prune_failed, (queue, self._retention)),
            ],
            command_timeout=UNBOUNDED,
        )
        return results[0].rowcount == 1

    async def fail_then_push(
        self,
        pool: PgPool,
        queue: str,
        lease: Lease,
        error: str,
        push_queue: str,
        job: Job,
        channels: tuple[str, str],
    ) -> bool:
        """Fail, then push; ``channels``: the failed queue's, ``push_queue``'s."""
        failed_channel, push_channel = channels
        args = (queue, lease.token, lease.job_id, error, push_queue, job.id, job.data)
        results = await pool.pipeline(
            [
                (self.fail_and_push, (*args, job.key or "", failed_channel)),
                (self.prune_failed, (queue, self._retention)),
                (_NOTIFY, (push_channel, "")),  # (spurious when the lease was lost: harmless)
            ],
            command_timeout=UNBOUNDED,
        )
        return results[0].rowcount == 1

    async def retry_job(
        self,
        pool: PgPool,
        queue: str,
        lease: Lease,
        delay: float,
        count_attempt: bool,
        channel: str,
    ) -> bool:
        keep_place = delay <= 0 and not count_attempt
        results = await pool.pipeline(
            [
                (
                    self.retry,
                    (
                        queue,
                        lease.token,
                        lease.job_id,
                        float(delay),
                        keep_place,
                        int(count_attempt),
                    ),
                ),
                (_NOTIFY, (channel, "later" if delay > 0 else "")),
            ],
            command_timeout=UNBOUNDED,
        )
        return results[0].rowcount == 1

    async def mark(
        self, pool: PgPool, statement: str, queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        tokens, ids = _arrays(leases)
        rows = await pool.fetch(statement, queue, tokens, ids, command_timeout=UNBOUNDED)
        return _answers(leases, {row[0] for row in rows})

    async def renew_jobs(self, pool: PgPool, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        held = await self.mark(pool, self.renew, queue, leases)
        lost = tuple(lease for lease, ok in zip(leases, held, strict=True) if not ok)
        return RenewOutcome(renewed=len(leases) - len(lost), lost=lost)

    async def recover_batch(
        self, conn: PgConnection, queue: str, threshold: float, max_stalled: int
    ) -> tuple[Recovery, int]:
        """One batch of a stalled sweep, in the caller's transaction: (what it did, the rows
        it looked at; :data:`RECOVER_BATCH` of them: there may be more)."""
        rows = await conn.fetch(self.stalled, queue, float(threshold), command_timeout=UNBOUNDED)
        now = await conn.fetchval(
            "SELECT extract(epoch FROM now())::float8", command_timeout=UNBOUNDED
        )
        prefix = secrets.token_hex(8) + ":"
        requeue: list[tuple[int, int, str]] = []
        release: list[tuple[int, str, int | None, str | None]] = []
        unreadable: list[int] = []
        exceeded: list[ClaimedJob] = []
        for i, (pk, job_id, *fields, worker, started, claimed_at) in enumerate(rows):
            if job_id is None:
                unreadable.append(pk)
                exceeded.append(unreadable_report(pk))
                continue
            problems = []
            if not (type(claimed_at) is float and abs(claimed_at) < float("inf")):
                problems.append(f"claimed_at: {describe(claimed_at)}, not a time")
            token = f"{prefix}{i}"
            job = read_job(job_id, token, fields, problems=problems)
            if job.damage is not None:
                # Re-leased to the sweep, which fails it: its stored fields stay as found.
                release.append((pk, token, None, None))
                exceeded.append(job)
                continue
            # Past the limit already: a sweep's lease that died before failing it. No
            # delivery, so no stall: exceeded again, as it was.
            again = job.stalled_count > max_stalled
            # Only a claim whose handler started counts.
            counted = not again and bool(started)
            stalls = job.stalls
            if not again:
                stalls = (*stalls, Stall(at=float(now), worker=str(worker), counted=counted))
            stalled_count = job.stalled_count + counted
            if again or (counted and stalled_count > max_stalled):
                release.append((pk, token, stalled_count, stalls_json(stalls)))
                exceeded.append(attrs.evolve(job, stalled_count=stalled_count, stalls=stalls))
            else:
                # A reclaimed job keeps its place: it waited its turn once already.
                requeue.append((pk, stalled_count, stalls_json(stalls)))
        if requeue:
            pks, counts, histories = zip(*requeue, strict=True)
            await conn.execute(
                self.requeue_stalled,
                list(pks),
                list(counts),
                list(histories),
                command_timeout=UNBOUNDED,
            )
        if release:
            pks, tokens, counts, histories = zip(*release, strict=True)
            await conn.execute(
                self.release,
                list(pks),
                list(tokens),
                list(counts),
                list(histories),
                command_timeout=UNBOUNDED,
            )
        if unreadable:
            await conn.execute(
                self.quarantine, unreadable, QUARANTINE_REASON, command_timeout=UNBOUNDED
            )
        return Recovery(recovered=len(requeue), exceeded=tuple(exceeded)), len(rows)

    async def size_of(self, pool: PgPool, queue: str) -> int:
        return int(await pool.fetchval(self.size, queue, command_timeout=UNBOUNDED))

    async def job_states(
        self, pool: PgPool, queue: str, job_ids: Sequence[str]
    ) -> list[JobState | None]:
        found: dict[str, JobState] = {}
        for job_id, claimed, worker in await pool.fetch(
            self.states, queue, list(job_ids), command_timeout=UNBOUNDED
        ):
            if claimed:
                found[job_id] = JobState(claimed=True, worker=worker)
            else:
                found.setdefault(job_id, JobState(claimed=False))
        return [found.get(job_id) for job_id in job_ids]

    async def failed(self, pool: PgPool, queue: str, limit: int) -> list[FailedJob]:
        return [
            read_failed(row)
            for row in await pool.fetch(self.failed_jobs, queue, limit, command_timeout=UNBOUNDED)
        ]

    async def requeue(
        self, pool: PgPool, queue: str, job_id: str, priority: int | None, channel: str
    ) -> bool:
        results = await pool.pipeline(
            [(self.requeue_failed, (queue, job_id, priority)), (_NOTIFY, (channel, ""))],
            command_timeout=UNBOUNDED,
        )
        return results[0].rowcount == 1

    async def queue_stats(self, pool: PgPool, queue: str) -> QueueStats:
        row = await pool.fetchrow(self.stats, queue, command_timeout=UNBOUNDED)
        assert row is not None
        ready, oldest, unknown, delayed, active, failed, now, limit, per_key = row
        age = None
        if ready and not unknown and oldest is not None:
            age = max(0.0, float(now) - float(oldest))
        limit = None if limit is None else int(limit)
        stats = QueueStats(int(ready), int(delayed), int(active), int(failed), age)
        return attrs.evolve(stats, limit=limit, per_key=bool(per_key))

    async def store_limit(
        self, pool: PgPool, queue: str, limit: int | None, per_key: bool, channel: str
    ) -> None:
        """Store (``None``: remove) ``queue``'s limit, and wake its waiters to look again."""
        if limit is None:
            change: tuple[str, Sequence[Any]] = (self.delete_limit, (queue,))
        else:
            change = (self.set_limit, (queue, limit, per_key))
        await pool.pipeline([change, (_NOTIFY, (channel, ""))], command_timeout=UNBOUNDED)
        if limit is None:
            self.limited.discard(queue)
        else:
            self.limited.add(queue)

    async def queues(self, pool: PgPool, statement: str, prefix: str) -> list[str]:
        return sorted(
            str(row[0]) for row in await pool.fetch(statement, prefix, command_timeout=UNBOUNDED)
        )

    async def quarantine_entries(
        self, pool: PgPool, queue: str, limit: int
    ) -> list[QuarantinedEntry]:
        return [
            QuarantinedEntry(queue=queue, reason=reason, raw=bytes(raw), at=float(at))
            for reason, raw, at in await pool.fetch(
                self.quarantined, queue, limit, command_timeout=UNBOUNDED
            )
        ]

    async def look(self, pool: PgPool, queue: str) -> tuple[bool, float | None]:
        """(whether ``queue`` has work now, seconds until its earliest delayed job is due)."""
        row = await pool.fetchrow(self.probe, queue, command_timeout=UNBOUNDED)
        assert row is not None
        ready, due, now = row
        if ready:
            return True, None
        if due is None:
            return False, None
        wait = float(due) - float(now)
        if not wait > 0 or wait == float("inf"):
            # Due now, or a due_at that is not a time (the next pop promotes it as damaged).
            return True, None
        return False, wait
