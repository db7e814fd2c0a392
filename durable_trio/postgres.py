"""Start a workflow, or push a job, inside a transaction the application already holds
(PostgreSQL backend; issue 32, item 3).

An application that writes its own rows (an order, a sign-up) and starts a workflow for them
wants both or neither: a run started after the commit is lost if the process dies in between,
one started before it runs for a row that was rolled back. These functions write what
``engine.start(..., detach=True)`` writes (a pending run nobody owns) or what the broker's push
writes (a job row) on the application's own connection, inside its open transaction, with the
same statements the stores run. The ``NOTIFY`` that wakes the engines (or the queue's
waiters) is sent in that transaction too, so PostgreSQL delivers it at the commit only: after
a commit, a reconciling engine of the namespace takes the run within milliseconds; after a
rollback, nothing was stored and nothing runs.

The connection is the application's: psycopg's blocking ``psycopg.Connection`` (a Trio
application calls it through ``trio.to_thread.run_sync``) for :func:`start_workflow` and
:func:`push_job`; psycopg's ``psycopg.AsyncConnection`` (an asyncio application) or a
connection of durable_trio's own Trio driver for :func:`start_workflow_async` and
:func:`push_job_async`. The caller commits or rolls back; these functions do neither. On a
connection in autocommit mode outside a transaction each statement commits at once (as
``engine.start(..., detach=True)`` does).

The tables must exist: open the backend once (its first open migrates them), or run
``durable-trio migrate URL`` (docs/deployment.md, "PostgreSQL"). Missing tables are a
:class:`~durable_trio.ConfigError`; the caller's transaction is then aborted (roll it back).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from ._arguments import (
    check_name,
    check_run_id,
    check_seconds,
    check_type,
    given,
)
from ._engine._debounce import check_folding, scoped_key
from ._engine._errors import EngineError
from ._engine._records import RunRecord, RunStatus, normalize_json
from ._engine._stores import _pg_starts as starts
from ._engine._stores import _pg_tables as sql
from ._engine._stores._wakes import DEBOUNCED, STARTS
from ._engine._stores.postgres import (
    debounce_params,
    insert_run_params,
    tag_rows_params,
    wake_payload,
    wakes_channel,
)
from ._engine._tags import check_tags
from ._errors import ConfigError
from ._postgres import PgConnection, PostgresError, quote_ident
from ._telemetry import run_trace
from .brokers._contract import Job
from .brokers.postgres import channel_for
from .brokers.postgres._operations import Operations

if TYPE_CHECKING:
    from collections.abc import Generator, Mapping

    import psycopg

    from ._engine._debounce import Debounce

__all__ = [
    "DEFAULT_SCHEMA",
    "push_job",
    "push_job_async",
    "start_workflow",
    "start_workflow_async",
]

#: The PostgreSQL schema of the tables when the backend's URL names none.
DEFAULT_SCHEMA: Final = "durable_trio"

#: SQLSTATEs of a statement on tables that are not there: no such table, no such schema.
_MISSING: Final = frozenset({"42P01", "3F000"})

_COLUMNS: Final = [c.strip() for c in sql.RUN_COLUMNS.split(",")]
_WORKFLOW_COLUMN: Final = _COLUMNS.index("workflow")
_STATUS_COLUMN: Final = _COLUMNS.index("status")

#: A statement (``$1`` parameters) and its parameters.
_Statement: TypeAlias = tuple[str, tuple[Any, ...]]
#: What a statement answered: the rows affected (or returned) and the rows.
_Answer: TypeAlias = tuple[int, list[tuple[Any, ...]]]
#: The statements of one call, each sent on the caller's connection, its answer sent back.
_Plan: TypeAlias = "Generator[_Statement, _Answer, str | None]"


# -- the public calls ------------------------------------------------------------------------


def start_workflow(
    conn: psycopg.Connection[Any],
    workflow: str,
    input: Any = None,
    *,
    namespace: str,
    run_id: str | None = None,
    timeout: float | None = None,
    schema: str = DEFAULT_SCHEMA,
    tags: Mapping[str, str] | None = None,
    dedup_key: str | None = None,
    debounce: Debounce | None = None,
) -> str:
    """Record a new run of ``workflow`` in the transaction open on ``conn``, as
    ``engine.start(..., detach=True)`` does: pending, no owner, taken over by an engine of
    ``namespace`` once the transaction commits (nothing is stored if it rolls back).

    Idempotent by ``run_id``: an id that exists (committed, or written earlier in this
    transaction) starts nothing and is returned. A concurrent transaction writing the same id
    makes this one wait for it, as any insert of a duplicate key does.

    Args:
        conn: the application's psycopg connection, its transaction open (or about to be:
            psycopg opens one at the first statement unless in autocommit mode).
        workflow: a workflow the engines of ``namespace`` register.
        input: its JSON input.
        namespace: the engines' namespace (their app's name unless they were opened with
            another).
        run_id: the run's id (default: a random one).
        timeout: seconds the run may take from now, as for ``engine.start``.
        schema: the PostgreSQL schema of the tables (the backend URL's ``schema``).
        tags: the run's tags, as for ``engine.start`` (stored and indexed with the run).
        dedup_key: as for ``engine.start``: while the run last started with this key (in
            ``workflow``) is unfinished, start nothing and return its id. The key's row is
            written (and locked) in this transaction: a concurrent start with the key waits
            for its commit or rollback; a rollback leaves no row.
        debounce: as for ``engine.start``: fold this start into the pending start of
            ``debounce.key`` (one upsert, in this transaction; a rollback undoes the fold).
            Its run is created when due by a reconciling engine (within its
            ``reconcile_interval``; no wake is sent for it).

    Returns:
        The run id (for ``dedup_key``, the unfinished run's if there is one; for
        ``debounce``, the run it is folded into: a run from its start on).

    Raises:
        ConfigError: durable_trio's tables are not in ``schema`` (the transaction is then
            aborted); an empty ``workflow``, ``namespace`` or ``run_id``, a bad schema name,
            a ``timeout`` that is not a number of seconds > 0, bad ``tags`` or
            ``dedup_key``; ``dedup_key`` or ``debounce`` with ``run_id`` or each other.
        TypeError: an argument of the wrong type.
        PayloadError: ``input`` is not a JSON value.
        EngineError: ``run_id`` exists as a run of another workflow.
        psycopg.Error: what the connection raises otherwise (a lost connection, ...).
    """
    plan = _start_plan(
        workflow, input, namespace, run_id, timeout, schema, "start_workflow",
        tags=tags, dedup_key=dedup_key, debounce=debounce,
    )  # fmt: skip
    run = _run_sync(conn, plan, schema)
    assert run is not None
    return run


async def start_workflow_async(
    conn: psycopg.AsyncConnection[Any] | PgConnection,
    workflow: str,
    input: Any = None,
    *,
    namespace: str,
    run_id: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (the run's, stored; not this call's)
    schema: str = DEFAULT_SCHEMA,
    tags: Mapping[str, str] | None = None,
    dedup_key: str | None = None,
    debounce: Debounce | None = None,
) -> str:
    """:func:`start_workflow` on an asynchronous connection: psycopg's ``AsyncConnection``
    (asyncio), or a connection of durable_trio's Trio driver.

    Raises:
        ConfigError: as :func:`start_workflow`.
        TypeError: as :func:`start_workflow`.
        PayloadError: as :func:`start_workflow`.
        EngineError: as :func:`start_workflow`.
    """
    call = "start_workflow_async"
    plan = _start_plan(
        workflow, input, namespace, run_id, timeout, schema, call,
        tags=tags, dedup_key=dedup_key, debounce=debounce,
    )  # fmt: skip
    run = await _run_async(conn, plan, schema)
    assert run is not None
    return run


def push_job(
    conn: psycopg.Connection[Any],
    queue: str,
    job: Job,
    *,
    priority: int | None = None,
    delay: float = 0.0,
    schema: str = DEFAULT_SCHEMA,
) -> None:
    """Push ``job`` onto ``queue`` in the transaction open on ``conn``, as the broker's
    ``push_on`` does (its row, and the ``NOTIFY`` that wakes the queue's consumers at the
    commit); nothing is pushed if the transaction rolls back.

    ``queue`` is the broker's queue name, the namespace included (``transport.names`` says
    them); ``delay`` counts from the start of the transaction (PostgreSQL's ``now()``).

    Raises:
        ConfigError: durable_trio's tables are not in ``schema`` (the transaction is then
            aborted); an empty ``queue``, a bad schema name, a negative ``delay``.
        TypeError: an argument of the wrong type.
        psycopg.Error: what the connection raises otherwise.
    """
    _run_sync(conn, _push_plan(queue, job, priority, delay, schema, "push_job"), schema)


async def push_job_async(
    conn: psycopg.AsyncConnection[Any] | PgConnection,
    queue: str,
    job: Job,
    *,
    priority: int | None = None,
    delay: float = 0.0,
    schema: str = DEFAULT_SCHEMA,
) -> None:
    """:func:`push_job` on an asynchronous connection (see :func:`start_workflow_async`).

    Raises:
        ConfigError: as :func:`push_job`.
        TypeError: as :func:`push_job`.
    """
    plan = _push_plan(queue, job, priority, delay, schema, "push_job_async")
    await _run_async(conn, plan, schema)


# -- what each call writes -------------------------------------------------------------------


def _start_plan(
    workflow: Any,
    input: Any,
    namespace: Any,
    run_id: Any,
    timeout: Any,
    schema: str,
    call: str,
    *,
    tags: Any = None,
    dedup_key: Any = None,
    debounce: Any = None,
) -> _Plan:
    """The statements of a detached start (``_engine/_new_run.py``'s ``record_new_run`` and
    ``record_debounced_start`` on the PostgreSQL store): the insert, then the ``STARTS`` wake
    if it created the run, else a look at the run that has the id; with ``dedup_key``, the
    key's row first (``create_run_deduped``); with ``debounce``, the one upsert of
    ``debounce_run`` (and the ``DEBOUNCED`` wake when it recorded a new start). Arguments are
    checked before the first statement."""
    check_name(workflow, call, "workflow")
    check_name(namespace, call, "namespace")
    check_run_id(run_id, call)
    check_folding(run_id, None, dedup_key, debounce, call)
    seconds = None if timeout is None else check_seconds(timeout, call, "timeout", positive=True)
    checked = check_tags(tags, f"{call}: tags")
    quoted = quote_ident(schema)
    value = normalize_json(input, f"the input of workflow {workflow!r}")
    now = time.time()
    run = RunRecord(
        run_id=run_id or uuid.uuid4().hex,
        workflow=workflow,
        input=value,
        status=RunStatus.PENDING,
        created_at=now,
        updated_at=now,
        timeout=seconds,
        trace=run_trace(workflow),
        tags=checked,
    )
    if debounce is not None:
        return _debounce_statements(
            quoted, debounce_params(namespace, scoped_key(workflow, debounce.key), run, now,
                                    debounce.delay, debounce.max_wait),
            wakes_channel(schema, namespace), run.run_id,
        )  # fmt: skip
    statements = _start_statements(
        quoted, insert_run_params(namespace, run, now), wakes_channel(schema, namespace), run
    )
    if dedup_key is None:
        return statements
    return _deduped_statements(quoted, namespace, scoped_key(workflow, dedup_key), run, statements)


def _deduped_statements(
    quoted: str, namespace: str, key: str, run: RunRecord, then: _Plan
) -> _Plan:
    """``create_run_deduped``'s statements: the key's row inserted (naming this run) or locked,
    then the run it names returned while it is unfinished, else the row taken over and
    ``then`` (the start's own statements) run."""
    params = (namespace, key, run.run_id)
    yield (starts.INSERT_DEDUP_KEY.replace("{schema}", quoted), params)
    _, rows = yield (starts.DEDUP_KEY_FOR_UPDATE.replace("{schema}", quoted), params[:2])
    holder = str(rows[0][0])
    if holder != run.run_id:
        _, found = yield (sql.GET_RUN.replace("{schema}", quoted), (namespace, holder))
        if found and not RunStatus(found[0][_STATUS_COLUMN]).terminal:
            return holder
        yield (starts.SET_DEDUP_KEY.replace("{schema}", quoted), params)
    return (yield from then)


def _debounce_statements(quoted: str, params: tuple[Any, ...], channel: str, new_id: str) -> _Plan:
    _, rows = yield (starts.DEBOUNCE.replace("{schema}", quoted), params)
    folded = str(rows[0][0])
    if folded == new_id:  # a new start: the store's DEBOUNCED wake, delivered at the commit
        yield (sql.NOTIFY, (channel, wake_payload(DEBOUNCED)))
    return folded


def _start_statements(quoted: str, values: tuple[Any, ...], channel: str, run: RunRecord) -> _Plan:
    namespace, run_id, workflow = values[0], values[1], values[2]
    inserted, _ = yield (sql.INSERT_RUN.replace("{schema}", quoted), values)
    if inserted == 1:
        if run.tags:  # its tags' index rows, as the store's create writes them
            yield (sql.INSERT_RUN_TAGS.replace("{schema}", quoted), tag_rows_params(namespace, run))
        # The wake the store's ring sends (a JSON text payload); PostgreSQL delivers it at the
        # commit, so an engine never looks before the run is there to take.
        yield (sql.NOTIFY, (channel, wake_payload(STARTS)))
        return str(run_id)
    _, rows = yield (sql.GET_RUN.replace("{schema}", quoted), (namespace, run_id))
    stored = rows[0][_WORKFLOW_COLUMN] if rows else workflow
    if stored != workflow:
        raise EngineError(f"run {run_id!r} exists as a run of {stored!r}, not {workflow!r}")
    return str(run_id)


def _push_plan(queue: Any, job: Any, priority: Any, delay: Any, schema: str, call: str) -> _Plan:
    """The broker's push statements (``brokers/postgres/_operations.py``): the insert and its
    ``NOTIFY``."""
    check_name(queue, call, "queue")
    check_type(job, Job, call, "job", optional=False)
    if type(job.id) is not str or not job.id or type(job.data) is not bytes:
        raise TypeError(f"{call}: job must have a non-empty str id and bytes data, got {job!r}")
    if priority is not None and (type(priority) is not int):
        raise TypeError(f"{call}: priority must be an int or None, got {given(priority)}")
    seconds = check_seconds(delay, call, "delay")
    operations = Operations(quote_ident(schema), failed_retention=0)
    statements = operations.push_statements(
        queue, job, priority or 0, seconds, channel_for(schema, queue)
    )
    return _each(statements)


def _each(statements: list[tuple[str, Any]]) -> _Plan:
    for query, params in statements:
        yield (query, tuple(params))
    return None


# -- running a plan on the caller's connection -----------------------------------------------


def _missing(schema: str, error: BaseException) -> ConfigError:
    return ConfigError(
        f"durable_trio's tables are not in the PostgreSQL schema {schema!r} of this database "
        f"({error}): apply the migrations first (`durable-trio migrate URL`, or open the "
        "backend once with a role that may create them); roll this transaction back"
    )


def _run_sync(conn: psycopg.Connection[Any], plan: _Plan, schema: str) -> str | None:
    import psycopg
    from psycopg.rows import tuple_row

    if not isinstance(conn, psycopg.Connection):
        raise TypeError(
            f"conn must be a psycopg.Connection (an AsyncConnection or durable_trio's own goes "
            f"to the *_async function), got {given(conn)}"
        )
    try:
        # Tuples whatever the connection's own row factory (an application's dict_row).
        with psycopg.RawCursor(conn, row_factory=tuple_row) as cursor:
            statement = next(plan)
            while True:
                cursor.execute(statement[0], statement[1])
                rows = cursor.fetchall() if cursor.description else []
                statement = plan.send((cursor.rowcount, rows))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except psycopg.Error as error:
        if error.sqlstate in _MISSING:
            raise _missing(schema, error) from error
        raise


async def _run_async(
    conn: psycopg.AsyncConnection[Any] | PgConnection, plan: _Plan, schema: str
) -> str | None:
    import psycopg
    from psycopg.rows import tuple_row

    try:
        if isinstance(conn, PgConnection):
            statement = next(plan)
            while True:
                result = await conn.execute(statement[0], *statement[1])
                statement = plan.send((result.rowcount, result.rows))
        elif isinstance(conn, psycopg.AsyncConnection):
            async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cursor:
                statement = next(plan)
                while True:
                    await cursor.execute(statement[0], statement[1])
                    rows = await cursor.fetchall() if cursor.description else []
                    statement = plan.send((cursor.rowcount, rows))
        else:
            raise TypeError(
                "conn must be a psycopg.AsyncConnection or a durable_trio PgConnection (a "
                f"blocking psycopg.Connection goes to the function without _async), got "
                f"{given(conn)}"
            )
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except (psycopg.Error, PostgresError) as error:
        if error.sqlstate in _MISSING:
            raise _missing(schema, error) from error
        raise
