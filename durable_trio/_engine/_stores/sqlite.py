"""The SQLite run store: two tables (``dt_runs``, ``dt_steps``) in the backend's database file.

It shares the broker's dedicated connection thread (see
:class:`~durable_trio._sqlite.ConnectionThread`) when given the broker, or opens its own
on a path. Clock: ``time.time()``, which every process on the machine shares.

Group commit:
    Every change runs inside a transaction in that thread, each in its own ``SAVEPOINT`` (so
    each multi-row change is atomic, and one that fails is rolled back alone). Changes made by
    concurrent tasks share one transaction: the first writer becomes the batch's leader, waits
    for the connection (the previous batch), and commits everything queued meanwhile at once.
    Under load this turns hundreds of ``BEGIN IMMEDIATE`` ... ``COMMIT`` round trips into a few;
    alone, a write costs what it did (one transaction).

Cancellation:
    A change, once submitted, runs to its end (shielded, bounded by ``busy_timeout`` plus a
    margin); a cancellation is delivered after it. So a cancelled call's change may have been
    made — the engine re-reads the store on resume, as it would after a crash.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import outcome
import trio

from ..._errors import BrokerError, BrokerUnavailable
from ..._sqlite import ConnectionThread, Doorbell, Synchronous, open_connection, translate_error
from .._records import (
    CANCEL_STEP_ID,
    Applied,
    RunPage,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    read_attempt_log,
    read_trace,
)
from ._paging import check_page, decode_cursor, encode_cursor
from ._wakes import RunWakes

if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

    from ...brokers.sqlite import SqliteBroker

__all__ = ["SqliteRunStore", "stored_namespaces"]

_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_runs (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        workflow TEXT NOT NULL,
        status TEXT NOT NULL,
        input TEXT NOT NULL,
        output TEXT NOT NULL DEFAULT 'null',
        error TEXT NOT NULL DEFAULT 'null',
        owner TEXT,
        lease_until REAL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        timeout REAL,
        trace TEXT,
        parent TEXT,
        depth INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (namespace, run_id)
    ) WITHOUT ROWID
    """,
    "CREATE INDEX IF NOT EXISTS dt_runs_seq ON dt_runs (namespace, seq)",
    """
    CREATE INDEX IF NOT EXISTS dt_runs_active ON dt_runs (namespace, seq)
        WHERE status IN ('pending', 'running')
    """,
    # (page_runs: a status or workflow filter walks its own index, newest first)
    "CREATE INDEX IF NOT EXISTS dt_runs_status ON dt_runs (namespace, status, seq)",
    "CREATE INDEX IF NOT EXISTS dt_runs_workflow ON dt_runs (namespace, workflow, seq)",
    """
    CREATE TABLE IF NOT EXISTS dt_steps (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        step_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        kind TEXT NOT NULL,
        name TEXT NOT NULL,
        status TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        input TEXT NOT NULL,
        output TEXT NOT NULL,
        error TEXT NOT NULL,
        retry TEXT NOT NULL,
        wake_at REAL,
        dispatched INTEGER NOT NULL,
        priority INTEGER,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        heartbeat_timeout REAL,
        heartbeat TEXT,
        attempts TEXT,
        PRIMARY KEY (namespace, run_id, step_id)
    ) WITHOUT ROWID
    """,
    # Schedules (issue 18): created in a file written before them when it is opened.
    """
    CREATE TABLE IF NOT EXISTS dt_schedules (
        namespace TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        last_tick REAL,
        PRIMARY KEY (namespace, name)
    ) WITHOUT ROWID
    """,
)

_RUN_COLUMNS: Final = (
    "run_id, workflow, input, status, created_at, updated_at, output, error, owner, lease_until, "
    "timeout, trace, parent, depth"
)
_STEP_COLUMNS: Final = (
    "run_id, step_id, kind, name, status, attempt, input, output, error, retry, wake_at, "
    "dispatched, priority, created_at, updated_at, heartbeat_timeout, heartbeat, attempts"
)

_INSERT_RUN: Final = f"""
    INSERT INTO dt_runs (namespace, seq, {_RUN_COLUMNS})
    VALUES (?1, (SELECT coalesce(max(seq), 0) + 1 FROM dt_runs WHERE namespace = ?1),
            ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
    ON CONFLICT (namespace, run_id) DO NOTHING
"""
_GET_RUN: Final = f"SELECT {_RUN_COLUMNS} FROM dt_runs WHERE namespace = ?1 AND run_id = ?2"
_ORPHANS: Final = """
    SELECT run_id FROM dt_runs INDEXED BY dt_runs_active
    WHERE namespace = ?1 AND status IN ('pending', 'running')
      AND (owner IS NULL OR lease_until IS NULL OR lease_until < ?2 OR (?3 AND owner = ?4))
    ORDER BY seq LIMIT ?5
"""
_CLAIM: Final = """
    UPDATE dt_runs SET owner = ?3, lease_until = ?4, status = 'running', updated_at = ?5
    WHERE namespace = ?1 AND run_id = ?2
"""
_RENEW: Final = """
    UPDATE dt_runs SET lease_until = ?4
    WHERE namespace = ?1 AND run_id = ?2 AND owner = ?3 AND status IN ('pending', 'running')
"""
_RELEASE: Final = """
    UPDATE dt_runs SET owner = NULL, lease_until = NULL, status = 'pending', updated_at = ?4
    WHERE namespace = ?1 AND run_id = ?2 AND owner = ?3 AND status IN ('pending', 'running')
"""
_FINISH: Final = """
    UPDATE dt_runs SET status = ?3, output = ?4, error = ?5, owner = NULL, lease_until = NULL,
        updated_at = ?6
    WHERE namespace = ?1 AND run_id = ?2 AND status IN ('pending', 'running', 'blocked')
"""
# The cancel mark of a run that ended otherwise (docs/engine.md, "A cancel racing the run's end").
_DROP_MARK: Final = f"""
    DELETE FROM dt_steps WHERE namespace = ?1 AND run_id = ?2 AND step_id = '{CANCEL_STEP_ID}'
"""
_INSERT_STEP: Final = f"""
    INSERT INTO dt_steps (namespace, position, {_STEP_COLUMNS})
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18,
            ?19, ?20)
    ON CONFLICT (namespace, run_id, step_id) DO NOTHING
"""
_GET_STEPS: Final = f"""
    SELECT {_STEP_COLUMNS} FROM dt_steps WHERE namespace = ?1 AND run_id = ?2
    ORDER BY position, step_id
"""
_GET_STEP: Final = f"""
    SELECT {_STEP_COLUMNS} FROM dt_steps WHERE namespace = ?1 AND run_id = ?2 AND step_id = ?3
"""
_STEP_STATE: Final = """
    SELECT s.status, s.attempt, r.status FROM dt_steps AS s
    JOIN dt_runs AS r ON r.namespace = s.namespace AND r.run_id = s.run_id
    WHERE s.namespace = ?1 AND s.run_id = ?2 AND s.step_id = ?3
"""
_UPDATE_STEP: Final = """
    UPDATE dt_steps SET status = ?4, attempt = ?5, output = ?6, error = ?7, wake_at = ?8,
        dispatched = ?9, updated_at = ?10, heartbeat = coalesce(?11, heartbeat), attempts = ?12
    WHERE namespace = ?1 AND run_id = ?2 AND step_id = ?3
"""
_MARK_DISPATCHED: Final = """
    UPDATE dt_steps SET dispatched = 1
    WHERE namespace = ?1 AND run_id = ?2 AND step_id = ?3 AND status = 'pending' AND attempt = ?4
"""

_TERMINAL_NAMES: Final = frozenset(s.value for s in RunStatus if s.terminal)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _optional_dumps(value: Any) -> str | None:
    """``None`` as SQL NULL (an update then keeps the column: ``coalesce``)."""
    return None if value is None else _dumps(value)


def _run(row: tuple[Any, ...]) -> RunRecord:
    (run_id, workflow, input_, status, created, updated, output, error, owner, lease,
     timeout, trace, parent, depth) = row  # fmt: skip
    return RunRecord(
        run_id=run_id,
        workflow=workflow,
        input=orjson.loads(input_),
        status=RunStatus(status),
        created_at=created,
        updated_at=updated,
        output=orjson.loads(output),
        error=orjson.loads(error),
        owner=owner,
        lease_until=lease,
        timeout=timeout,
        trace=read_trace(trace),
        parent=parent,
        depth=depth,
    )


def _step(row: tuple[Any, ...]) -> StepRecord:
    (run_id, step_id, kind, name, status, attempt, input_, output, error, retry, wake_at,
     dispatched, priority, created, updated, heartbeat_timeout, heartbeat,
     attempts) = row  # fmt: skip
    return StepRecord(
        run_id=run_id,
        step_id=step_id,
        kind=StepKind(kind),
        name=name,
        status=StepState(status),
        attempt=attempt,
        input=orjson.loads(input_),
        output=orjson.loads(output),
        error=orjson.loads(error),
        retry=orjson.loads(retry),
        wake_at=wake_at,
        dispatched=bool(dispatched),
        priority=priority,
        created_at=created,
        updated_at=updated,
        heartbeat_timeout=heartbeat_timeout,
        heartbeat=_beat(heartbeat),
        attempts=read_attempt_log(attempts),
    )


def _beat(text: Any) -> Any:
    """A stored last beat; advisory, so a damaged one reads as none."""
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


#: Seconds a batch may take beyond ``busy_timeout`` before its writers give up on it.
_BATCH_MARGIN: Final = 5.0


@attrs.define(eq=False)
class _Batch:
    """Changes queued by concurrent writers, committed in one transaction."""

    ops: list[Callable[[sqlite3.Connection], Any]] = attrs.Factory(list)
    results: list[outcome.Outcome[Any]] = attrs.Factory(list)
    done: trio.Event = attrs.Factory(trio.Event)


def _own_copy(exc: BrokerError) -> BrokerError:
    """A fresh error of ``exc``'s type and message for one writer of a failed batch (each
    writer raises its own, with its own traceback), caused by what caused ``exc``."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:  # a subclass with another signature: the plain kind, same words
        copy = BrokerUnavailable(str(exc)) if isinstance(exc, BrokerUnavailable) else (
            BrokerError(str(exc))
        )
    copy.__cause__ = exc.__cause__ if exc.__cause__ is not None else exc
    return copy


def _run_batch(
    ops: Sequence[Callable[[sqlite3.Connection], Any]], db: sqlite3.Connection
) -> list[outcome.Outcome[Any]]:
    """Each op in its own savepoint: a failing op is rolled back alone and reported."""
    results: list[outcome.Outcome[Any]] = []
    for op in ops:
        db.execute("SAVEPOINT dt_op")
        try:
            value = op(db)
        except Exception as exc:
            if not db.in_transaction:
                # SQLite rolled the whole transaction back itself (it does on a full disk, an
                # I/O error, a lost lock): every change of the batch is gone, so the batch
                # fails, each writer with its own copy of the real error (not a confusing
                # "no such savepoint").
                raise
            db.execute("ROLLBACK TO dt_op")
            db.execute("RELEASE dt_op")
            if isinstance(exc, sqlite3.ProgrammingError | sqlite3.InterfaceError):
                # A value SQLite cannot bind: a programming error no retry can fix, never
                # the transient BrokerError the engine would retry forever.
                misuse = TypeError(f"the SQLite run store cannot write this change: {exc}")
                misuse.__cause__ = exc
                results.append(outcome.Error(misuse))
            elif isinstance(exc, sqlite3.Error):
                translated = translate_error(exc)
                translated.__cause__ = exc
                results.append(outcome.Error(translated))
            else:
                results.append(outcome.Error(exc))
        else:
            db.execute("RELEASE dt_op")
            results.append(outcome.Value(value))
    return results


def _create_schema(db: sqlite3.Connection) -> None:
    for statement in _SCHEMA:
        db.execute(statement)
    for statement in _SIGNAL_SCHEMA:  # issue 18: added to older files when opened
        db.execute(statement)
    # A file written before runs had a timeout: add the column (NULL, no timeout).
    columns = {row[1] for row in db.execute("PRAGMA table_info(dt_runs)")}
    if "timeout" not in columns:
        db.execute("ALTER TABLE dt_runs ADD COLUMN timeout REAL")
    # A file written before runs kept their trace: add the column (NULL: untraced).
    if "trace" not in columns:
        db.execute("ALTER TABLE dt_runs ADD COLUMN trace TEXT")
    # A file written before child workflows: add the column (NULL: no parent).
    if "parent" not in columns:
        db.execute("ALTER TABLE dt_runs ADD COLUMN parent TEXT")
    # A file written before the child depth limit (issue 36): 0, as a run with no ancestor.
    if "depth" not in columns:
        db.execute("ALTER TABLE dt_runs ADD COLUMN depth INTEGER NOT NULL DEFAULT 0")
    # A file written before step heartbeats: add their columns (NULL: none).
    columns = {row[1] for row in db.execute("PRAGMA table_info(dt_steps)")}
    if "heartbeat_timeout" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN heartbeat_timeout REAL")
    if "heartbeat" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN heartbeat TEXT")
    # A file written before attempt logs: add the column (NULL: no attempt logged).
    if "attempts" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN attempts TEXT")


# -- operations (each runs in the connection thread, as one transaction) -----------------------


def _op_put_schedule(
    ns: str, name: str, spec: str, replace: bool, db: sqlite3.Connection
) -> bool:
    if replace:
        db.execute(
            "INSERT INTO dt_schedules (namespace, name, spec) VALUES (?, ?, ?) "
            "ON CONFLICT (namespace, name) DO UPDATE SET spec = excluded.spec",
            (ns, name, spec),
        )
        return True
    cursor = db.execute(
        "INSERT OR IGNORE INTO dt_schedules (namespace, name, spec) VALUES (?, ?, ?)",
        (ns, name, spec),
    )
    return cursor.rowcount == 1


def _op_mark_schedule_tick(ns: str, name: str, tick: float, db: sqlite3.Connection) -> None:
    db.execute(
        "UPDATE dt_schedules SET last_tick = ? WHERE namespace = ? AND name = ? "
        "AND (last_tick IS NULL OR last_tick < ?)",
        (tick, ns, name, tick),
    )


def _op_create_run(
    ns: str, run: RunRecord, now: float, db: sqlite3.Connection
) -> tuple[RunRecord, bool]:
    cursor = db.execute(
        _INSERT_RUN,
        (ns, run.run_id, run.workflow, _dumps(run.input), run.status.value, now, now,
         _dumps(run.output), _dumps(run.error), run.owner, run.lease_until, run.timeout,
         _optional_dumps(run.trace), run.parent, run.depth),
    )  # fmt: skip
    if cursor.rowcount == 1:  # inserted as given: no need to read it back
        return attrs.evolve(run, created_at=now, updated_at=now), True
    return _run(db.execute(_GET_RUN, (ns, run.run_id)).fetchone()), False


def _op_get_run(ns: str, run_id: str, db: sqlite3.Connection) -> RunRecord | None:
    row = db.execute(_GET_RUN, (ns, run_id)).fetchone()
    return None if row is None else _run(row)


def _op_list_runs(
    ns: str, status: str | None, workflow: str | None, limit: int, db: sqlite3.Connection
) -> list[RunRecord]:
    query = f"SELECT {_RUN_COLUMNS} FROM dt_runs WHERE namespace = ?"
    params: list[Any] = [ns]
    if status is not None:
        query += " AND status = ?"
        params.append(status)
    if workflow is not None:
        query += " AND workflow = ?"
        params.append(workflow)
    query += " ORDER BY seq DESC LIMIT ?"
    params.append(limit)
    return [_run(row) for row in db.execute(query, params)]


def _op_page_runs(
    ns: str,
    filters: tuple[str | None, str | None, str | None, float | None, float | None],
    limit: int,
    below: int | None,
    db: sqlite3.Connection,
) -> RunPage:
    status, workflow, tenant, since, until = filters
    query = f"SELECT seq, {_RUN_COLUMNS} FROM dt_runs WHERE namespace = ?"
    params: list[Any] = [ns]
    for clause, value in (
        (" AND seq < ?", below),
        (" AND status = ?", status),
        (" AND workflow = ?", workflow),
        (" AND created_at >= ?", since),
        (" AND created_at < ?", until),
    ):
        if value is not None:
            query += clause
            params.append(value)
    if tenant is not None:  # the stored ids "{tenant}/...": a range of the key
        query += " AND run_id >= ? AND run_id < ?"
        params += [tenant + "/", tenant + "0"]  # ('0' follows '/')
    query += " ORDER BY seq DESC LIMIT ?"
    params.append(limit + 1)
    rows = db.execute(query, params).fetchall()
    runs = [_run(row[1:]) for row in rows[:limit]]
    more = len(rows) > limit
    return RunPage(runs, encode_cursor(rows[limit - 1][0]) if more else None)


def _op_count_runs(ns: str, db: sqlite3.Connection) -> dict[RunStatus, int]:
    query = "SELECT status, count(*) FROM dt_runs WHERE namespace = ?1 GROUP BY status"
    return {RunStatus(status): int(n) for status, n in db.execute(query, (ns,))}


_REOPEN_RUN: Final = """
    UPDATE dt_runs SET status = 'pending', owner = NULL, lease_until = NULL, output = 'null',
        error = 'null', timeout = ?3, updated_at = ?4
    WHERE namespace = ?1 AND run_id = ?2 AND status IN ('failed', 'blocked')
"""
_REOPEN_STEP: Final = """
    UPDATE dt_steps SET status = ?4, attempt = ?5, error = ?6, retry = ?7, wake_at = ?8,
        dispatched = ?9, updated_at = ?10, attempts = ?11
    WHERE namespace = ?1 AND run_id = ?2 AND step_id = ?3
"""


def _op_reopen(
    ns: str,
    run_id: str,
    steps: Sequence[StepRecord],
    timeout: float | None,
    now: float,
    db: sqlite3.Connection,
) -> bool:
    failed = _run_status(ns, run_id, db) == RunStatus.FAILED.value
    if db.execute(_REOPEN_RUN, (ns, run_id, timeout, now)).rowcount != 1:
        return False
    if failed:
        db.execute(_DROP_MARK, (ns, run_id))  # a stale mark of its previous life
    db.executemany(
        _REOPEN_STEP,
        [
            (ns, run_id, s.step_id, s.status.value, s.attempt, _dumps(s.error),
             _dumps(s.retry), s.wake_at, int(s.dispatched), now, _dumps(s.attempts))
            for s in steps
        ],
    )  # fmt: skip
    return True


def _op_claim(
    ns: str,
    owner: str,
    lease: float,
    include_own: bool,
    limit: int,
    now: float,
    db: sqlite3.Connection,
) -> list[RunRecord]:
    ids = [row[0] for row in db.execute(_ORPHANS, (ns, now, include_own, owner, limit))]
    db.executemany(_CLAIM, [(ns, run_id, owner, now + lease, now) for run_id in ids])
    return [_run(db.execute(_GET_RUN, (ns, run_id)).fetchone()) for run_id in ids]


def _op_renew(
    ns: str, owner: str, run_ids: Sequence[str], lease: float, now: float, db: sqlite3.Connection
) -> set[str]:
    until = now + lease
    kept: set[str] = set()
    for run_id in run_ids:
        if db.execute(_RENEW, (ns, run_id, owner, until)).rowcount == 1:
            kept.add(run_id)
    return kept


def _op_release(
    ns: str, owner: str, run_ids: Sequence[str], now: float, db: sqlite3.Connection
) -> None:
    db.executemany(_RELEASE, [(ns, run_id, owner, now) for run_id in run_ids])


def _op_finish(
    ns: str, run_id: str, status: str, output: str, error: str, now: float, db: sqlite3.Connection
) -> bool:
    cursor = db.execute(_FINISH, (ns, run_id, status, output, error, now))
    if cursor.rowcount != 1:
        return False
    if status in (RunStatus.COMPLETED.value, RunStatus.FAILED.value):
        db.execute(_DROP_MARK, (ns, run_id))  # ended before the cancel reached it
    return True


_SIGNAL_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_signals (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        name TEXT NOT NULL,
        seq INTEGER NOT NULL,
        payload TEXT NOT NULL,
        PRIMARY KEY (namespace, run_id, name, seq)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS dt_events (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (namespace, run_id, key)
    )
    """,
)


def _run_status(ns: str, run_id: str, db: sqlite3.Connection) -> str | None:
    """The run's status (``None``: unknown), read in the caller's transaction."""
    row = db.execute(
        "SELECT status FROM dt_runs WHERE namespace = ? AND run_id = ?", (ns, run_id)
    ).fetchone()
    return None if row is None else str(row[0])


def _unknown_or_ended(ns: str, run_id: str, db: sqlite3.Connection) -> bool:
    """Whether the run is missing or ended (read in the caller's transaction)."""
    status = _run_status(ns, run_id, db)
    return status is None or RunStatus(status).terminal


def _op_append_signal(
    ns: str, run_id: str, name: str, payload: str, db: sqlite3.Connection
) -> int | None:
    if _unknown_or_ended(ns, run_id, db):
        return None
    (last,) = db.execute(
        "SELECT COALESCE(MAX(seq), 0) FROM dt_signals WHERE namespace = ? AND run_id = ? "
        "AND name = ?",
        (ns, run_id, name),
    ).fetchone()
    seq = int(last) + 1
    db.execute(
        "INSERT INTO dt_signals (namespace, run_id, name, seq, payload) VALUES (?, ?, ?, ?, ?)",
        (ns, run_id, name, seq, payload),
    )
    return seq


def _op_read_signal(
    ns: str, run_id: str, name: str, seq: int, db: sqlite3.Connection
) -> str | None:
    row = db.execute(
        "SELECT payload FROM dt_signals WHERE namespace = ? AND run_id = ? AND name = ? "
        "AND seq = ?",
        (ns, run_id, name, seq),
    ).fetchone()
    return None if row is None else str(row[0])


def _op_put_event(ns: str, run_id: str, key: str, value: str, db: sqlite3.Connection) -> None:
    db.execute(
        "INSERT INTO dt_events (namespace, run_id, key, value) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (namespace, run_id, key) DO UPDATE SET value = excluded.value",
        (ns, run_id, key, value),
    )


def _op_get_events(ns: str, run_id: str, db: sqlite3.Connection) -> dict[str, str]:
    rows = db.execute(
        "SELECT key, value FROM dt_events WHERE namespace = ? AND run_id = ?", (ns, run_id)
    ).fetchall()
    return {str(k): str(v) for k, v in rows}


def _op_get_steps(ns: str, run_id: str, db: sqlite3.Connection) -> list[StepRecord]:
    return [_step(row) for row in db.execute(_GET_STEPS, (ns, run_id))]


def _op_get_steps_many(
    ns: str, keys: Sequence[tuple[str, str]], db: sqlite3.Connection
) -> list[StepRecord | None]:
    out: list[StepRecord | None] = []
    for run_id, step_id in keys:
        row = db.execute(_GET_STEP, (ns, run_id, step_id)).fetchone()
        out.append(None if row is None else _step(row))
    return out


def _op_begin_step(ns: str, step: StepRecord, now: float, db: sqlite3.Connection) -> StepRecord:
    position = int(step.step_id) if step.step_id.isdigit() else 0
    cursor = db.execute(
        _INSERT_STEP,
        (ns, position, step.run_id, step.step_id, step.kind.value, step.name, step.status.value,
         step.attempt, _dumps(step.input), _dumps(step.output), _dumps(step.error),
         _dumps(step.retry), step.wake_at, int(step.dispatched), step.priority, now, now,
         step.heartbeat_timeout, _optional_dumps(step.heartbeat), _dumps(step.attempts)),
    )  # fmt: skip
    if cursor.rowcount == 1:  # inserted as given: no need to read it back
        return attrs.evolve(step, created_at=now, updated_at=now)
    return _step(db.execute(_GET_STEP, (ns, step.run_id, step.step_id)).fetchone())


def _op_begin_step_unless_finished(
    ns: str, step: StepRecord, now: float, db: sqlite3.Connection
) -> StepRecord | None:
    if _unknown_or_ended(ns, step.run_id, db):
        return None
    return _op_begin_step(ns, step, now, db)  # in the same transaction as the check


def _verdict(ns: str, run_id: str, step_id: str, attempt: int, db: sqlite3.Connection) -> Applied:
    row = db.execute(_STEP_STATE, (ns, run_id, step_id)).fetchone()
    if row is None:
        return Applied.MISSING
    status, stored_attempt, run_status = row
    if run_status in _TERMINAL_NAMES:
        return Applied.RUN_FINISHED
    if status != StepState.PENDING.value:
        return Applied.DUPLICATE
    if stored_attempt != attempt:
        return Applied.STALE
    return Applied.APPLIED


def _op_update_step(
    ns: str, step: StepRecord, expect_attempt: int, now: float, db: sqlite3.Connection
) -> Applied:
    verdict = _verdict(ns, step.run_id, step.step_id, expect_attempt, db)
    if verdict is Applied.APPLIED:
        db.execute(
            _UPDATE_STEP,
            (ns, step.run_id, step.step_id, step.status.value, step.attempt,
             _dumps(step.output), _dumps(step.error), step.wake_at, int(step.dispatched),
             now, _optional_dumps(step.heartbeat), _dumps(step.attempts)),
        )  # fmt: skip
    return verdict


def _op_mark_dispatched(
    ns: str, run_id: str, step_id: str, attempt: int, db: sqlite3.Connection
) -> bool:
    return db.execute(_MARK_DISPATCHED, (ns, run_id, step_id, attempt)).rowcount == 1


#: How often (seconds) a watching waiter checks that the wakes socket is still there.
_WAKES_CHECK: Final = 1.0


class SqliteRunStore:
    """A :class:`~durable_trio.RunStore` in a SQLite file (runs of one ``namespace``).

    Create one with :meth:`attach` (sharing a broker's connection thread: one thread, one
    connection for broker, key store and run store) or :meth:`open` (its own connection).
    Both create the tables if missing.
    """

    def __init__(
        self, connection: ConnectionThread, namespace: str, *, busy_timeout: float = 5.0
    ) -> None:
        """Wrap a connection this store holds one use of. Use :meth:`attach` or :meth:`open`."""
        self._db = connection
        self._ns = namespace
        self._clock: Callable[[], float] = time.time
        self.trio_clock = False
        """Whether :meth:`now` is trio's clock (see :meth:`follow_trio_clock`)."""
        self.path = connection.path
        self._closed = False
        self._batch: _Batch | None = None
        self._writing = trio.Lock()
        self._batch_bound = busy_timeout + _BATCH_MARGIN
        self.batches = 0
        """Write transactions committed (statistics: compare with the writes made)."""
        self.writes = 0
        """Changes made."""
        self._token = trio.lowlevel.current_trio_token()
        self._doorbell = Doorbell(
            self.path,
            self._on_doorbell,
            suffix=".wakes",
            purpose="signals, events and cancels are noticed by the waiters' poll",
        )
        self._checked_at = -_WAKES_CHECK
        self.wakes = RunWakes(listen=self._listen)
        """Its waiters in this process; other processes' rings reach them through datagram
        sockets in ``<file>.wakes/`` (see ``_wakes.py``), bound once a waiter watches."""

    # -- wakes (issue 18) -------------------------------------------------------------------

    def _listen(self) -> None:
        """A waiter watches: bind our socket (once), and now and then check it is still there
        (a removed socket is bound again; meanwhile the waiters' poll covers)."""
        now = trio.current_time()
        if now - self._checked_at >= _WAKES_CHECK:
            self._checked_at = now
            self._doorbell.listen()
            self._doorbell.check()

    def _on_doorbell(self, names: frozenset[str] | None) -> None:
        """(The doorbell's thread.) Hand the keys rung for this namespace to Trio."""
        keys: list[str] | None = None
        if names is not None:
            prefix = self._ns + "\x00"
            keys = [name[len(prefix) :] for name in names if name.startswith(prefix)]
            if not keys:
                return
        with contextlib.suppress(trio.RunFinishedError):  # the process is leaving
            self._token.run_sync_soon(self.wakes.wake, keys)

    async def ring(self, key: str) -> None:
        """Wake the waiters of ``key`` in this process and, by datagram, in every other
        process on this file (best-effort: the waiters' poll covers a lost one)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._ring(key)

    def _ring(self, key: str) -> None:
        self.wakes.wake((key,))
        self._doorbell.ring(f"{self._ns}\x00{key}")

    @classmethod
    async def attach(cls, broker: SqliteBroker, namespace: str) -> SqliteRunStore:
        """A store on ``broker``'s connection thread (and file); the connection stays open
        until the broker and every store on it are closed.

        Raises:
            BrokerUnavailable: the broker is closed.
            BrokerError: the tables could not be created.
        """
        if broker.closed:
            raise BrokerUnavailable(f"the SQLite broker on {broker.path!r} is closed")
        connection = broker.connection
        connection.acquire()
        return await cls._on(connection, namespace)

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        namespace: str,
        *,
        busy_timeout: float = 5.0,
        synchronous: Synchronous = "NORMAL",
    ) -> SqliteRunStore:
        """A store on a connection of its own to ``path`` (created if missing).

        Raises:
            BrokerUnavailable: the file cannot be opened or stays locked.
            BrokerError: any other SQLite error.
        """
        connection = await open_connection(path, busy_timeout=busy_timeout, synchronous=synchronous)
        return await cls._on(connection, namespace)

    @classmethod
    async def _on(cls, connection: ConnectionThread, namespace: str) -> SqliteRunStore:
        store = cls(connection, namespace)
        try:
            await connection.call(_create_schema, write=True)
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.aclose()
            raise
        return store

    def now(self) -> float:
        """The wall clock (``time.time()``), shared by every process on the machine; after
        :meth:`follow_trio_clock`, trio's."""
        return self._clock()

    def follow_trio_clock(self) -> None:
        """Read trio's clock instead of the wall clock, for tests under a virtual clock that
        run every engine in one process (as the memory store does): timers then wake at
        their exact virtual time. Call it before an engine opens on the store."""
        self._clock = trio.current_time
        self.trio_clock = True

    async def _read(self, fn: Any) -> Any:
        if self._closed:
            raise BrokerUnavailable(f"the SQLite run store on {self.path!r} is closed")
        return await self._db.call(fn, write=False)

    async def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Queue ``fn`` in the open batch (opening one, as its leader, if there is none) and
        return its result once the batch committed (see the module docstring)."""
        if self._closed:
            raise BrokerUnavailable(f"the SQLite run store on {self.path!r} is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        batch = self._batch
        leader = batch is None
        if batch is None:
            batch = self._batch = _Batch()
        index = len(batch.ops)
        batch.ops.append(fn)
        with trio.move_on_after(self._batch_bound, shield=True) as bound:
            if leader:
                try:
                    # Waiting for the previous batch is what lets this one fill up.
                    async with self._writing:
                        if self._batch is batch:
                            self._batch = None  # closed: later writers start the next one
                        self.batches += 1
                        self.writes += len(batch.ops)
                        batch.results = await self._db.call(
                            partial(_run_batch, tuple(batch.ops)), write=True
                        )
                except BrokerError as exc:
                    # One error object per writer: an ``outcome.Error`` unwraps once, so one
                    # shared by the batch would hand every writer but the first an
                    # ``AlreadyUsedError`` (not a BrokerError: nothing retries it).
                    batch.results = [outcome.Error(_own_copy(exc)) for _ in batch.ops]
                finally:
                    if self._batch is batch:
                        self._batch = None
                    batch.done.set()
            else:
                await batch.done.wait()
        if bound.cancelled_caught or index >= len(batch.results):
            raise BrokerUnavailable(
                f"the SQLite run store on {self.path!r} did not commit within "
                f"{self._batch_bound:g} s"
            )
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancellation meanwhile lands now
        return batch.results[index].unwrap()

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        result: tuple[RunRecord, bool] = await self._write(
            partial(_op_create_run, self._ns, run, self.now())
        )
        return result

    async def get_run(self, run_id: str) -> RunRecord | None:
        result: RunRecord | None = await self._read(partial(_op_get_run, self._ns, run_id))
        return result

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        status_name = None if status is None else status.value
        result: list[RunRecord] = await self._read(
            partial(_op_list_runs, self._ns, status_name, workflow, limit)
        )
        return result

    async def page_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        check_page(limit, since, until, tenant)
        below = decode_cursor(cursor)
        filters = (None if status is None else status.value, workflow, tenant, since, until)
        result: RunPage = await self._read(partial(_op_page_runs, self._ns, filters, limit, below))
        return result

    async def count_runs(self) -> dict[RunStatus, int]:
        result: dict[RunStatus, int] = await self._read(partial(_op_count_runs, self._ns))
        return result

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        result: bool = await self._write(
            partial(_op_reopen, self._ns, run_id, tuple(steps), run_timeout, self.now())
        )
        return result

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        result: list[RunRecord] = await self._write(
            partial(_op_claim, self._ns, owner, lease, include_own, limit, self.now())
        )
        return result

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return set()
        result: set[str] = await self._write(
            partial(_op_renew, self._ns, owner, tuple(run_ids), lease, self.now())
        )
        return result

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return
        await self._write(partial(_op_release, self._ns, owner, tuple(run_ids), self.now()))

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        op = partial(
            _op_finish, self._ns, run_id, status.value, _dumps(output), _dumps(error), self.now()
        )
        result: bool = await self._write(op)
        return result

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        result: list[StepRecord] = await self._read(partial(_op_get_steps, self._ns, run_id))
        return result

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        (found,) = await self.get_steps_many([(run_id, step_id)])
        return found

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        result: list[StepRecord | None] = await self._read(
            partial(_op_get_steps_many, self._ns, tuple(keys))
        )
        return result

    async def begin_step(self, step: StepRecord) -> StepRecord:
        result: StepRecord = await self._write(partial(_op_begin_step, self._ns, step, self.now()))
        return result

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        result: StepRecord | None = await self._write(
            partial(_op_begin_step_unless_finished, self._ns, step, self.now())
        )
        return result

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        result: Applied = await self._write(
            partial(_op_update_step, self._ns, step, expect_attempt, self.now())
        )
        return result

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        result: bool = await self._write(
            partial(_op_mark_dispatched, self._ns, run_id, step_id, attempt)
        )
        return result

    # -- schedules --------------------------------------------------------------------------

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        written: bool = await self._write(partial(_op_put_schedule, self._ns, name, spec, replace))
        return written

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        ns = self._ns

        def read(db: sqlite3.Connection) -> list[tuple[str, str, float | None]]:
            rows = db.execute(
                "SELECT name, spec, last_tick FROM dt_schedules WHERE namespace = ? "
                "ORDER BY name",
                (ns,),
            )
            return [(str(n), str(sp), None if t is None else float(t)) for n, sp, t in rows]

        rows: list[tuple[str, str, float | None]] = await self._read(read)
        return rows

    async def delete_schedule(self, name: str) -> bool:
        ns = self._ns

        def delete(db: sqlite3.Connection) -> bool:
            cursor = db.execute(
                "DELETE FROM dt_schedules WHERE namespace = ? AND name = ?", (ns, name)
            )
            return cursor.rowcount == 1

        deleted: bool = await self._write(delete)
        return deleted

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        await self._write(partial(_op_mark_schedule_tick, self._ns, name, tick))

    async def aclose(self) -> None:
        """Release the store's use of the connection (idempotent)."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._doorbell.close()
        await self._db.release()

    # -- signals and events (issue 18) ----------------------------------------------------

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        result: int | None = await self._write(
            partial(_op_append_signal, self._ns, run_id, name, payload)
        )
        if result is not None:
            self._ring(run_id)
        return result

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        result: str | None = await self._read(partial(_op_read_signal, self._ns, run_id, name, seq))
        return result

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await self._write(partial(_op_put_event, self._ns, run_id, key, value))
        self._ring(run_id)

    async def get_events(self, run_id: str) -> dict[str, str]:
        result: dict[str, str] = await self._read(partial(_op_get_events, self._ns, run_id))
        return result


def _op_namespaces(connection: sqlite3.Connection) -> list[str]:
    tables = {
        row[0]
        for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN "
            "('dt_runs', 'dt_schedules')"
        )
    }
    found: set[str] = set()
    for table in sorted(tables):  # a file a worker made alone has no run tables yet
        rows = connection.execute(f"SELECT DISTINCT namespace FROM {table}")
        found.update(row[0] for row in rows)
    return sorted(found)


async def stored_namespaces(broker: SqliteBroker) -> list[str]:
    """The namespaces with a run or a schedule in ``broker``'s file, sorted.

    Raises:
        BrokerUnavailable: the broker is closed or the file cannot be read.
    """
    if broker.closed:
        raise BrokerUnavailable(f"the SQLite broker on {broker.path!r} is closed")
    return await broker.connection.call(_op_namespaces, write=False)
