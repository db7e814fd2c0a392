"""The SQLite run store's tables and the SQL of each of its changes and reads, as plain
functions on a connection (each runs in the connection thread, inside the transaction, or the
savepoint of a group commit, that :class:`~.sqlite.SqliteRunStore` opened for it).

The rows are read back into the engine's records here (``dt_runs`` into
:class:`~durable_trio._engine._records.RunRecord`, ``dt_steps`` into ``StepRecord``); the
schema grows by ``ALTER TABLE`` on open (:func:`create_schema`), never by a new file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson

from ..._logs import get_logger
from .._records import (
    CANCEL_STEP_ID,
    Applied,
    DamagedRun,
    RunDataError,
    RunPage,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    first_or_later,
    read_attempt_log,
    read_trace,
)
from .._tags import read_tags, tags_json
from ._generation_tables import SQLITE_GENERATIONS_SCHEMA, backfill_ends
from ._paging import encode_cursor, skip_damaged

log = get_logger("durable_trio")

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Sequence


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
        state TEXT,
        PRIMARY KEY (namespace, name)
    ) WITHOUT ROWID
    """,
)

_RUN_COLUMNS: Final = (
    "run_id, workflow, input, status, created_at, updated_at, output, error, owner, lease_until, "
    "timeout, trace, parent, depth, tags"
)
_STEP_COLUMNS: Final = (
    "run_id, step_id, kind, name, status, attempt, input, output, error, retry, wake_at, "
    "dispatched, priority, created_at, updated_at, heartbeat_timeout, heartbeat, attempts"
)

_INSERT_RUN: Final = f"""
    INSERT INTO dt_runs (namespace, seq, {_RUN_COLUMNS})
    VALUES (?1, (SELECT coalesce(max(seq), 0) + 1 FROM dt_runs WHERE namespace = ?1),
            ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
    ON CONFLICT (namespace, run_id) DO NOTHING
"""
_GET_RUN: Final = f"SELECT {_RUN_COLUMNS} FROM dt_runs WHERE namespace = ?1 AND run_id = ?2"
# A lease that is no time (text, infinity: damaged data; numbers sort below text in SQLite)
# has expired: the claim writes a time over it (docs/concepts.md, "Damaged run rows").
_ORPHANS: Final = """
    SELECT run_id FROM dt_runs INDEXED BY dt_runs_active
    WHERE namespace = ?1 AND status IN ('pending', 'running')
      AND (owner IS NULL OR lease_until IS NULL OR lease_until < ?2 OR (?3 AND owner = ?4)
           OR NOT lease_until BETWEEN -1e308 AND 1e308)
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


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _optional_dumps(value: Any) -> str | None:
    """``None`` as SQL NULL (an update then keeps the column: ``coalesce``)."""
    return None if value is None else dumps(value)


def _run(row: tuple[Any, ...]) -> RunRecord:
    """The run of a row; :class:`RunDataError` if a column cannot be read (damaged)."""
    try:
        return _read_run(row)
    except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise RunDataError(f"run {row[0]!r}: its stored row cannot be read ({exc})") from exc


def _step(row: tuple[Any, ...]) -> StepRecord:
    """The checkpoint of a row; :class:`RunDataError` if a column cannot be read."""
    try:
        return _read_step(row)
    except (ValueError, TypeError) as exc:
        raise RunDataError(
            f"run {row[0]!r}: its stored checkpoint {row[1]!r} cannot be read ({exc})"
        ) from exc


def read_claims(
    rows: Sequence[tuple[Any, ...]],
) -> tuple[list[RunRecord], list[tuple[str, RunDataError]]]:
    """The claimed runs of ``rows``, and (run id, error) of each row that cannot be read (the
    store sets those aside: :func:`set_aside_error`)."""
    runs: list[RunRecord] = []
    damaged: list[tuple[str, RunDataError]] = []
    for row in rows:
        try:
            runs.append(_run(row))
        except RunDataError as exc:
            damaged.append((str(row[0]), exc))
    return runs, damaged


def read_listed(rows: Sequence[tuple[Any, ...]]) -> tuple[list[RunRecord], list[DamagedRun]]:
    """The runs of a listing's ``rows``, and each row that cannot be read as a
    :class:`DamagedRun`: one damaged row is named, never fails the listing."""
    runs, damaged = read_claims(rows)
    return runs, [DamagedRun(run_id, str(exc)) for run_id, exc in damaged]


def started_input(run_id: str, text: str | bytes) -> tuple[Any, bool]:
    """The input of a debounced start just made a run, and whether it could be read: a
    damaged one (not JSON) leaves the run to its claim, which sets it aside (failed with
    :class:`RunDataError`) as any damaged row, instead of failing the engine's start loop."""
    try:
        return orjson.loads(text), True
    except orjson.JSONDecodeError as exc:
        log.warning("run %r: its debounced start's input cannot be read (%s)", run_id, exc)
        return None, False


def set_aside_error(exc: RunDataError) -> str:
    """The stored error (JSON) of a claimed run set aside as damaged: failed, never driven,
    so one damaged row cannot stop the claims of the runs beside it (a WARNING is logged)."""
    log.warning("%s: the run is set aside (failed)", exc)
    return dumps({"type": type(exc).__name__, "message": str(exc)})


def _read_run(row: tuple[Any, ...]) -> RunRecord:
    (run_id, workflow, input_, status, created, updated, output, error, owner, lease,
     timeout, trace, parent, depth, tags) = row  # fmt: skip
    return RunRecord(
        run_id=run_id,
        workflow=workflow,
        input=orjson.loads(input_),
        status=RunStatus(status),
        created_at=_number(created, "created_at"),
        updated_at=_number(updated, "updated_at"),
        output=orjson.loads(output),
        error=orjson.loads(error),
        owner=owner,
        lease_until=_optional_number(lease, "lease_until"),
        timeout=_optional_number(timeout, "timeout"),
        trace=read_trace(trace),
        parent=parent,
        depth=_integer(depth, "depth"),
        tags=read_tags(tags),
    )


def _read_step(row: tuple[Any, ...]) -> StepRecord:
    (run_id, step_id, kind, name, status, attempt, input_, output, error, retry, wake_at,
     dispatched, priority, created, updated, heartbeat_timeout, heartbeat,
     attempts) = row  # fmt: skip
    return StepRecord(
        run_id=run_id,
        step_id=step_id,
        kind=StepKind(kind),
        name=name,
        status=StepState(status),
        attempt=first_or_later(_integer(attempt, "attempt")),
        input=orjson.loads(input_),
        output=orjson.loads(output),
        error=orjson.loads(error),
        retry=orjson.loads(retry),
        wake_at=_optional_number(wake_at, "wake_at"),
        dispatched=bool(dispatched),
        priority=None if priority is None else _integer(priority, "priority"),
        created_at=_number(created, "created_at"),
        updated_at=_number(updated, "updated_at"),
        heartbeat_timeout=_optional_number(heartbeat_timeout, "heartbeat_timeout"),
        heartbeat=_beat(heartbeat),
        attempts=read_attempt_log(attempts),
    )


def _number(value: Any, column: str) -> float:
    """A stored time or number of seconds. SQLite keeps any value in any column (a REAL
    column may hold text), PostgreSQL's double precision a NaN: one that is no number is
    damaged (``TypeError``: the row mappers make it a :class:`RunDataError`), caught here
    rather than where arithmetic meets it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise TypeError(f"its {column} {value!r} is not a number")  # (NaN: PostgreSQL's)
    return value


def _optional_number(value: Any, column: str) -> float | None:
    return None if value is None else _number(value, column)


def _integer(value: Any, column: str) -> int:
    """A stored count (an INTEGER column may hold text or a REAL, ``9e999`` too): one that is
    no integer is damaged, as :func:`_number`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"its {column} {value!r} is not an integer")
    return value


def _beat(text: Any) -> Any:
    """A stored last beat; advisory, so a damaged one reads as none."""
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def create_schema(db: sqlite3.Connection) -> None:
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
    # A file written before run tags (issue 34): the column (NULL: none) and their index.
    if "tags" not in columns:
        db.execute("ALTER TABLE dt_runs ADD COLUMN tags TEXT")
    for statement in TAG_SCHEMA:
        db.execute(statement)
    # A file written before step heartbeats: add their columns (NULL: none).
    columns = {row[1] for row in db.execute("PRAGMA table_info(dt_steps)")}
    if "heartbeat_timeout" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN heartbeat_timeout REAL")
    if "heartbeat" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN heartbeat TEXT")
    # A file written before attempt logs: add the column (NULL: no attempt logged).
    if "attempts" not in columns:
        db.execute("ALTER TABLE dt_steps ADD COLUMN attempts TEXT")
    # A file written before schedule overlap policies: add their state (NULL: none yet).
    columns = {row[1] for row in db.execute("PRAGMA table_info(dt_schedules)")}
    if "state" not in columns:
        db.execute("ALTER TABLE dt_schedules ADD COLUMN state TEXT")
    for statement in RETENTION_SCHEMA:  # issue 34: added to older files when opened
        db.execute(statement)
    had_ends = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'dt_generation_ends'"
    ).fetchone()
    for statement in SQLITE_GENERATIONS_SCHEMA:  # continue-as-new: added to older files too
        db.execute(statement)
    if had_ends is None:  # the ends of generations archived before the table existed
        db.execute(backfill_ends("dt_generation_ends", "dt_generations", "dt_steps", "dt_runs"))


# -- operations (each runs in the connection thread, as one transaction) -----------------------


def put_schedule(
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


def mark_schedule_tick(ns: str, name: str, tick: float, db: sqlite3.Connection) -> None:
    db.execute(
        "UPDATE dt_schedules SET last_tick = ? WHERE namespace = ? AND name = ? "
        "AND (last_tick IS NULL OR last_tick < ?)",
        (tick, ns, name, tick),
    )


def put_schedule_state(ns: str, name: str, state: str, db: sqlite3.Connection) -> None:
    db.execute(
        "UPDATE dt_schedules SET state = ? WHERE namespace = ? AND name = ?", (state, ns, name)
    )


def create_run(
    ns: str, run: RunRecord, now: float, db: sqlite3.Connection
) -> tuple[RunRecord, bool]:
    cursor = db.execute(
        _INSERT_RUN,
        (ns, run.run_id, run.workflow, dumps(run.input), run.status.value, now, now,
         dumps(run.output), dumps(run.error), run.owner, run.lease_until, run.timeout,
         _optional_dumps(run.trace), run.parent, run.depth, tags_json(run.tags)),
    )  # fmt: skip
    if cursor.rowcount == 1:  # inserted as given: no need to read it back
        index_tags(ns, run, db)
        return attrs.evolve(run, created_at=now, updated_at=now), True
    return _run(db.execute(_GET_RUN, (ns, run.run_id)).fetchone()), False


def get_run(ns: str, run_id: str, db: sqlite3.Connection) -> RunRecord | None:
    row = db.execute(_GET_RUN, (ns, run_id)).fetchone()
    return None if row is None else _run(row)


def list_runs(
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
    return skip_damaged(*read_listed(db.execute(query, params).fetchall()))


def page_runs(
    ns: str,
    filters: tuple[str | None, str | None, str | None, float | None, float | None],
    limit: int,
    below: int | None,
    db: sqlite3.Connection,
    tags: dict[str, str] | None = None,
) -> RunPage:
    status, workflow, tenant, since, until = filters
    if tags:  # walk the first tag's index, the others checked by their index (issue 34)
        return page_tagged(ns, filters, limit, below, tags, db)
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
    runs, damaged = read_listed([row[1:] for row in rows[:limit]])
    more = len(rows) > limit
    return RunPage(runs, encode_cursor(rows[limit - 1][0]) if more else None, damaged)


def count_runs(ns: str, db: sqlite3.Connection) -> dict[RunStatus, int]:
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


def reopen(
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
            (ns, run_id, s.step_id, s.status.value, s.attempt, dumps(s.error),
             dumps(s.retry), s.wake_at, int(s.dispatched), now, dumps(s.attempts))
            for s in steps
        ],
    )  # fmt: skip
    return True


def claim(
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
    runs, damaged = read_claims([db.execute(_GET_RUN, (ns, run_id)).fetchone() for run_id in ids])
    for run_id, exc in damaged:
        finish(ns, run_id, RunStatus.FAILED.value, "null", set_aside_error(exc), now, db)
    return runs


def renew(
    ns: str, owner: str, run_ids: Sequence[str], lease: float, now: float, db: sqlite3.Connection
) -> set[str]:
    until = now + lease
    kept: set[str] = set()
    for run_id in run_ids:
        if db.execute(_RENEW, (ns, run_id, owner, until)).rowcount == 1:
            kept.add(run_id)
    return kept


def release(
    ns: str, owner: str, run_ids: Sequence[str], now: float, db: sqlite3.Connection
) -> None:
    db.executemany(_RELEASE, [(ns, run_id, owner, now) for run_id in run_ids])


def finish(
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


def append_signal(
    ns: str, run_id: str, name: str, payload: str, db: sqlite3.Connection
) -> int | None:
    if _unknown_or_ended(ns, run_id, db):
        return None
    # (A seq that is no integer, text or a REAL: damaged, left out; its row is never read.)
    (last,) = db.execute(
        "SELECT COALESCE(MAX(seq), 0) FROM dt_signals WHERE namespace = ? AND run_id = ? "
        "AND name = ? AND typeof(seq) = 'integer'",
        (ns, run_id, name),
    ).fetchone()
    if last >= _LAST_SEQ:
        raise RunDataError(
            f"run {run_id!r}: its signals {name!r} cannot take another: a stored seq is "
            f"{last} (damaged)"
        )
    seq = int(last) + 1
    db.execute(
        "INSERT INTO dt_signals (namespace, run_id, name, seq, payload) VALUES (?, ?, ?, ?, ?)",
        (ns, run_id, name, seq, payload),
    )
    return seq


#: The largest seq SQLite's INTEGER holds (one more does not fit).
_LAST_SEQ: Final = 2**63 - 1


def read_signal(
    ns: str, run_id: str, name: str, seq: int, db: sqlite3.Connection
) -> str | None:
    row = db.execute(
        "SELECT payload FROM dt_signals WHERE namespace = ? AND run_id = ? AND name = ? "
        "AND seq = ?",
        (ns, run_id, name, seq),
    ).fetchone()
    return None if row is None else str(row[0])


def put_event(ns: str, run_id: str, key: str, value: str, db: sqlite3.Connection) -> None:
    db.execute(
        "INSERT INTO dt_events (namespace, run_id, key, value) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (namespace, run_id, key) DO UPDATE SET value = excluded.value",
        (ns, run_id, key, value),
    )


def get_events(ns: str, run_id: str, db: sqlite3.Connection) -> dict[str, str]:
    rows = db.execute(
        "SELECT key, value FROM dt_events WHERE namespace = ? AND run_id = ?", (ns, run_id)
    ).fetchall()
    return {str(k): str(v) for k, v in rows}


def get_steps(ns: str, run_id: str, db: sqlite3.Connection) -> list[StepRecord]:
    return [_step(row) for row in db.execute(_GET_STEPS, (ns, run_id))]


def get_steps_many(
    ns: str, keys: Sequence[tuple[str, str]], db: sqlite3.Connection
) -> list[StepRecord | None]:
    out: list[StepRecord | None] = []
    for run_id, step_id in keys:
        row = db.execute(_GET_STEP, (ns, run_id, step_id)).fetchone()
        out.append(None if row is None else _step(row))
    return out


def begin_step(ns: str, step: StepRecord, now: float, db: sqlite3.Connection) -> StepRecord:
    position = int(step.step_id) if step.step_id.isdigit() else 0
    cursor = db.execute(
        _INSERT_STEP,
        (ns, position, step.run_id, step.step_id, step.kind.value, step.name, step.status.value,
         step.attempt, dumps(step.input), dumps(step.output), dumps(step.error),
         dumps(step.retry), step.wake_at, int(step.dispatched), step.priority, now, now,
         step.heartbeat_timeout, _optional_dumps(step.heartbeat), dumps(step.attempts)),
    )  # fmt: skip
    if cursor.rowcount == 1:  # inserted as given: no need to read it back
        return attrs.evolve(step, created_at=now, updated_at=now)
    return _step(db.execute(_GET_STEP, (ns, step.run_id, step.step_id)).fetchone())


def begin_step_unless_finished(
    ns: str, step: StepRecord, now: float, db: sqlite3.Connection
) -> StepRecord | None:
    if _unknown_or_ended(ns, step.run_id, db):
        return None
    return begin_step(ns, step, now, db)  # in the same transaction as the check


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


def update_step(
    ns: str, step: StepRecord, expect_attempt: int, now: float, db: sqlite3.Connection
) -> Applied:
    verdict = _verdict(ns, step.run_id, step.step_id, expect_attempt, db)
    if verdict is Applied.APPLIED:
        db.execute(
            _UPDATE_STEP,
            (ns, step.run_id, step.step_id, step.status.value, step.attempt,
             dumps(step.output), dumps(step.error), step.wake_at, int(step.dispatched),
             now, _optional_dumps(step.heartbeat), dumps(step.attempts)),
        )  # fmt: skip
    return verdict


def mark_dispatched(
    ns: str, run_id: str, step_id: str, attempt: int, db: sqlite3.Connection
) -> bool:
    return db.execute(_MARK_DISPATCHED, (ns, run_id, step_id, attempt)).rowcount == 1


def namespaces(connection: sqlite3.Connection) -> list[str]:
    """The namespaces with a run or a schedule in the file, sorted."""
    present = {
        row[0]
        for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN "
            "('dt_runs', 'dt_schedules')"
        )
    }
    found: set[str] = set()
    for table in sorted(present):  # a file a worker made alone has no run tables yet
        rows = connection.execute(f"SELECT DISTINCT namespace FROM {table}")
        found.update(row[0] for row in rows)
    return sorted(found)


# -- run tags (issue 34) ------------------------------------------------------------------------

#: The tag index: one row per tag of a run, so ``--tag k=v`` walks ``(namespace, key, value)``
#: newest first by ``seq`` (the primary key is that index), never every run.
TAG_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_run_tags (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        seq INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        PRIMARY KEY (namespace, key, value, seq)
    ) WITHOUT ROWID
    """,
)


def index_tags(ns: str, run: RunRecord, db: sqlite3.Connection) -> None:
    """The tag index rows of ``run``, just inserted (in its transaction)."""
    if not run.tags:
        return
    db.executemany(
        "INSERT OR IGNORE INTO dt_run_tags (namespace, key, value, seq, run_id) "
        "SELECT namespace, ?, ?, seq, run_id FROM dt_runs WHERE namespace = ? AND run_id = ?",
        [(key, value, ns, run.run_id) for key, value in run.tags.items()],
    )


_TAGGED_COLUMNS: Final = ", ".join("r." + c.strip() for c in _RUN_COLUMNS.split(","))


def tagged_filters(tags: dict[str, str], numbered: bool = False) -> tuple[str, list[Any]]:
    """The tag part of a tagged page's ``WHERE`` (``t``: the first tag's index rows, keys in
    sorted order; each other tag an index lookup at the same ``seq``; ``{tags}`` stands for
    the index table) and its parameters: ``?`` placeholders, or with ``numbered``
    PostgreSQL's ``$n`` from ``$2`` (``$1`` is the namespace)."""
    params: list[Any] = []
    where = []
    for at, (key, value) in enumerate(sorted(tags.items())):
        k, v = (f"${len(params) + 2}", f"${len(params) + 3}") if numbered else ("?", "?")
        params += [key, value]
        if at == 0:
            where.append(f"t.key = {k} AND t.value = {v}")
        else:
            where.append(
                "EXISTS (SELECT 1 FROM {tags} AS o WHERE o.namespace = t.namespace"
                f" AND o.key = {k} AND o.value = {v} AND o.seq = t.seq)"
            )
    return " AND ".join(where), params


def page_tagged(
    ns: str,
    filters: tuple[str | None, str | None, str | None, float | None, float | None],
    limit: int,
    below: int | None,
    tags: dict[str, str],
    db: sqlite3.Connection,
) -> RunPage:
    """:func:`page_runs` of the runs carrying every tag of ``tags``: the first tag's index,
    newest first (``seq``), joined to each run, the other filters checked on the run."""
    status, workflow, tenant, since, until = filters
    where, tag_params = tagged_filters(tags)
    query = (
        f"SELECT t.seq, {_TAGGED_COLUMNS} FROM dt_run_tags AS t"
        " JOIN dt_runs AS r"
        " ON r.namespace = t.namespace AND r.run_id = t.run_id AND r.seq = t.seq"
        " WHERE t.namespace = ? AND " + where.replace("{tags}", "dt_run_tags")
    )
    params: list[Any] = [ns, *tag_params]
    for clause, value in (
        (" AND t.seq < ?", below),
        (" AND r.status = ?", status),
        (" AND r.workflow = ?", workflow),
        (" AND r.created_at >= ?", since),
        (" AND r.created_at < ?", until),
    ):
        if value is not None:
            query += clause
            params.append(value)
    if tenant is not None:
        query += " AND r.run_id >= ? AND r.run_id < ?"
        params += [tenant + "/", tenant + "0"]
    query += " ORDER BY t.seq DESC LIMIT ?"
    params.append(limit + 1)
    rows = db.execute(query, params).fetchall()
    runs, damaged = read_listed([row[1:] for row in rows[:limit]])
    more = len(rows) > limit
    return RunPage(runs, encode_cursor(rows[limit - 1][0]) if more else None, damaged)
# -- retention (issue 34) -------------------------------------------------------------------------

_FINISHED: Final = "('completed', 'failed', 'cancelled')"

#: The finished runs by end time (a finished run's ``updated_at``), all and per workflow: a
#: prune walks them from the oldest end, never every run (partial: unfinished runs stay out).
RETENTION_SCHEMA: Final = (
    f"""
    CREATE INDEX IF NOT EXISTS dt_runs_ended ON dt_runs (namespace, updated_at)
        WHERE status IN {_FINISHED}
    """,
    f"""
    CREATE INDEX IF NOT EXISTS dt_runs_ended_workflow ON dt_runs (namespace, workflow, updated_at)
        WHERE status IN {_FINISHED}
    """,
)

# ?1 namespace, ?2 ended before, ?3 workflow (NULL: any). A child whose parent exists
# unfinished is kept (the parent may not have recorded its end yet).
_PRUNABLE: Final = f"""
    FROM dt_runs AS r
    WHERE r.namespace = ?1 AND r.status IN {_FINISHED} AND r.updated_at < ?2
      AND (?3 IS NULL OR r.workflow = ?3)
      AND NOT EXISTS (
          SELECT 1 FROM dt_runs AS p
          WHERE p.namespace = r.namespace AND p.run_id = r.parent
            AND p.status NOT IN {_FINISHED})
"""
_PRUNABLE_IDS: Final = f"SELECT r.run_id {_PRUNABLE} ORDER BY r.updated_at LIMIT ?4"
_PRUNABLE_IDS_OF: Final = (
    f"SELECT r.run_id {_PRUNABLE} AND r.workflow = ?3 ORDER BY r.updated_at LIMIT ?4"
)
_COUNT_PRUNABLE: Final = f"SELECT count(*) {_PRUNABLE}"
_RUN_TABLES: Final = (
    "dt_steps", "dt_generations", "dt_generation_ends", "dt_signals", "dt_events", "dt_runs"
)
#: The run's rows, its own last (all in the caller's transaction: a run whole or gone).
_DELETE_RUN_ROWS: Final = (
    # its tag index rows first, found by its tags and seq (the index's own key; issue 34)
    """
    DELETE FROM dt_run_tags WHERE namespace = ?1 AND (key, value, seq) IN (
        SELECT j.key, j.value, r.seq FROM dt_runs AS r, json_each(r.tags) AS j
        WHERE r.namespace = ?1 AND r.run_id = ?2 AND json_valid(r.tags))
    """,
    *(
        f"DELETE FROM {table} WHERE namespace = ?1 AND run_id = ?2"
        for table in _RUN_TABLES
    ),
    # the dedup key row still naming it (issue 33; one a newer run of the key took over names
    # that run, and stays)
    "DELETE FROM dt_dedup_keys WHERE namespace = ?1 AND run_id = ?2",
)
# A loose index scan of dt_runs_ended_workflow: one step per workflow, not per run.
_FINISHED_WORKFLOWS: Final = f"""
    WITH RECURSIVE w(name) AS (
        SELECT min(workflow) FROM dt_runs WHERE namespace = ?1 AND status IN {_FINISHED}
        UNION ALL
        SELECT (SELECT min(workflow) FROM dt_runs
                WHERE namespace = ?1 AND status IN {_FINISHED} AND workflow > w.name)
        FROM w WHERE w.name IS NOT NULL
    )
    SELECT name FROM w WHERE name IS NOT NULL
"""


def prune_finished(
    ns: str, ended_before: float, workflow: str | None, limit: int, db: sqlite3.Connection
) -> list[str]:
    query = _PRUNABLE_IDS if workflow is None else _PRUNABLE_IDS_OF
    ids = [str(row[0]) for row in db.execute(query, (ns, ended_before, workflow, limit))]
    for statement in _DELETE_RUN_ROWS:
        db.executemany(statement, [(ns, run_id) for run_id in ids])
    return ids


def count_finished(
    ns: str, ended_before: float, workflow: str | None, db: sqlite3.Connection
) -> int:
    (count,) = db.execute(_COUNT_PRUNABLE, (ns, ended_before, workflow)).fetchone()
    return int(count)


def finished_workflows(ns: str, db: sqlite3.Connection) -> list[str]:
    return sorted(str(row[0]) for row in db.execute(_FINISHED_WORKFLOWS, (ns,)))
