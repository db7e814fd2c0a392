"""The PostgreSQL run store: runs and their checkpoints in tables of the backend's schema, the
namespace a column (see ``_pg_tables.py`` for the tables and the SQL of each change).

Every change is one statement, or one transaction sent as one pipeline (one round trip), or,
where a later statement depends on what an earlier one read, one explicit transaction: a crash
never leaves half a change behind, and concurrent writers (other tasks, other processes) are
serialized by row locks (``_pg_tables.py`` says how).

Clock: ``time.time()``, as the Redis store (durable timers and leases are computed from
:meth:`PostgresRunStore.now`; keep the machines' clocks in sync); after
:meth:`~PostgresRunStore.follow_trio_clock`, trio's (tests under a virtual clock).

Wakes (issue 18): a store rings by ``pg_notify`` on its namespace's channel, inside the
transaction that stored the signal or event (a wake is sent only if the change committed), or
on its own for the engine's rings. Other processes hear it through a :class:`NotifyHub` (one
``LISTEN`` connection shared by the backend), given to the store; without one they only poll,
as every waiter does anyway as a safety net.

Cancellation:
    A change, once sent, runs to its end (shielded, bounded); a cancellation is delivered after
    it. So a cancelled call's change may have been made, as with SQLite and Redis: the engine
    re-reads the store on resume, as it would after a crash. Reads are cancelled at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import attrs
import orjson
import trio

from ..._errors import BrokerError, BrokerUnavailable
from ..._postgres import WriteBatcher
from ..._postgres._migrations import migrate, quote_ident
from .._records import Applied, RunPage, RunRecord, RunStatus, StepRecord, read_trace
from .._tags import check_tags, read_tags, tags_json
from . import _pg_starts as starts
from . import _pg_tables as sql
from ._paging import check_page, decode_cursor, encode_cursor, skip_damaged
from ._sqlite_tables import (
    _optional_dumps,
    _run,
    _step,
    dumps,
    read_claims,
    read_listed,
    set_aside_error,
    started_input,
    tagged_filters,
)
from ._wakes import RunWakes

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from ..._postgres import PgPool, Result

__all__ = ["NotifyHub", "PostgresRunStore", "PostgresRunStores", "wakes_channel"]

_T = TypeVar("_T")

#: Seconds a change may take (waiting for a pooled connection included) before it gives up.
_WRITE_BOUND: Final = 60.0

#: A ``NOTIFY`` payload is at most 8,000 bytes; a longer key is sent as "wake everyone".
_MAX_PAYLOAD: Final = 7000


class NotifyHub(Protocol):
    """What the store needs of the backend's ``LISTEN`` connection (``_postgres/_hub.py``)."""

    def subscribe_soon(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """Call ``callback(payload)`` for every notification on ``channel`` from now on (once
        the hub's task has sent the ``LISTEN``), and ``callback(None)`` after a reconnection
        (notifications may have been missed)."""
        ...


def wakes_channel(schema: str, namespace: str) -> str:
    """The ``NOTIFY`` channel of ``namespace``'s wakes in ``schema``: a digest, so any
    namespace fits PostgreSQL's 63-byte identifiers."""
    digest = hashlib.blake2b(f"{schema}\x00{namespace}".encode(), digest_size=12).hexdigest()
    return f"dt_runs_{digest}"


def wake_payload(key: str) -> str:
    """A wake key as a ``NOTIFY`` payload: JSON text (keys hold ``\\x00``, which ``text``
    cannot); ``""`` (wake every waiter) for a key too long to send."""
    text = orjson.dumps(key).decode()
    return text if len(text.encode()) <= _MAX_PAYLOAD else ""


def insert_run_params(namespace: str, run: RunRecord, now: float) -> tuple[Any, ...]:
    """The parameters of :data:`~._pg_tables.INSERT_RUN` for ``run`` created at ``now``
    (the store's ``create_run``, and a start in the application's own transaction)."""
    return (namespace, run.run_id, run.workflow, dumps(run.input), run.status.value, now,
            dumps(run.output), dumps(run.error), run.owner, run.lease_until, run.timeout,
            _optional_dumps(run.trace), run.parent, run.depth, tags_json(run.tags))  # fmt: skip


def debounce_params(
    namespace: str, key: str, run: RunRecord, now: float, delay: float, max_wait: float | None
) -> tuple[Any, ...]:
    """The parameters of ``_pg_starts.DEBOUNCE`` for a start of ``run`` folded into ``key``
    (the store's ``debounce_run``, and a start in the application's own transaction)."""
    return (namespace, key, run.run_id, run.workflow, dumps(run.input), run.timeout,
            _optional_dumps(run.trace), now, delay, max_wait, tags_json(run.tags))  # fmt: skip


def tag_rows_params(namespace: str, run: RunRecord) -> tuple[Any, ...]:
    """The parameters of :data:`~._pg_tables.INSERT_RUN_TAGS` for ``run`` (it has tags)."""
    keys, values = list(run.tags), list(run.tags.values())
    return (namespace, run.run_id, keys, values, tags_json(run.tags))


class PostgresRunStore:
    """A :class:`~durable_trio.RunStore` in PostgreSQL (runs of one ``namespace``).

    Create one with :meth:`open` (which applies the migrations) or through
    :class:`PostgresRunStores`. The pool (and the hub) are the caller's: :meth:`aclose` closes
    neither.

    Args:
        pool: the pool its statements run on.
        schema: the PostgreSQL schema of its tables.
        namespace: whose runs.
        hub: where other processes' wakes are heard (``None``: the waiters poll).
    """

    def __init__(
        self,
        pool: PgPool,
        schema: str,
        namespace: str,
        *,
        hub: NotifyHub | None = None,
    ) -> None:
        self._pool = pool
        # Changes of concurrent tasks share round trips, each its own transaction.
        self._batcher = WriteBatcher(pool, bound=_WRITE_BOUND)
        self.schema = schema
        self._quoted = quote_ident(schema)
        self._ns = namespace
        self._hub = hub
        self._channel = wakes_channel(schema, namespace)
        self._subscribed = False
        self._closed = False
        self._clock: Callable[[], float] = time.time
        self.trio_clock = False
        """Whether :meth:`now` is trio's clock (see :meth:`follow_trio_clock`)."""
        self.wakes = RunWakes(listen=self._listen)
        """Its waiters in this process; other processes' rings reach them by ``NOTIFY`` on
        :func:`wakes_channel`, heard through the hub (subscribed once a waiter watches)."""

    @classmethod
    async def open(
        cls, pool: PgPool, schema: str, namespace: str, *, hub: NotifyHub | None = None
    ) -> PostgresRunStore:
        """A store whose tables are created or brought up to date in ``schema``.

        Raises:
            ConfigError: a bad schema name.
            BrokerUnavailable: the server cannot be reached.
            BrokerError: the migrations failed, or the schema is newer than this code.
        """
        store = cls(pool, schema, namespace, hub=hub)
        await migrate(pool, schema, "runs", sql.RUNS_MIGRATIONS)
        return store

    def now(self) -> float:
        """The wall clock (``time.time()``); after :meth:`follow_trio_clock`, trio's."""
        return self._clock()

    def follow_trio_clock(self) -> None:
        """Read trio's clock instead of the wall clock, for tests under a virtual clock that
        run every engine in one process (as the memory store does): timers then wake at
        their exact virtual time. Call it before an engine opens on the store."""
        self._clock = trio.current_time
        self.trio_clock = True

    async def aclose(self) -> None:
        """Stop using the pool; later calls raise ``BrokerUnavailable`` (idempotent). A hub
        subscription cannot be taken back: its rings are ignored from now on."""
        self._closed = True
        await trio.lowlevel.checkpoint()

    # -- wakes (issue 18) -------------------------------------------------------------------

    def _listen(self) -> None:
        """A waiter watches: subscribe to the namespace's channel (once)."""
        if not self._subscribed and self._hub is not None and not self._closed:
            self._subscribed = True
            self._hub.subscribe_soon(self._channel, self._on_notify)

    def _on_notify(self, payload: str | None) -> None:
        """(The hub's task.) Wake the waiters of the key ``payload`` names; all of them after a
        reconnection, or for a payload that is not a key."""
        if self._closed:
            return
        key: object = None
        if payload:
            with contextlib.suppress(orjson.JSONDecodeError):
                key = orjson.loads(payload)
        self.wakes.wake((key,) if isinstance(key, str) else None)

    async def ring(self, key: str) -> None:
        """Wake the waiters of ``key`` here, and notify every other process (best-effort: a
        ring the server did not take is covered by the waiters' poll)."""
        self.wakes.wake((key,))
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        with contextlib.suppress(BrokerError):
            payload = wake_payload(key)
            await self._write(lambda: self._pool.execute(sql.NOTIFY, self._channel, payload))

    # -- calls ------------------------------------------------------------------------------

    def _s(self, template: str) -> str:
        return template.replace("{schema}", self._quoted)

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable(
                f"the PostgreSQL run store of {self._ns!r} in schema {self.schema!r} is closed"
            )

    async def _write(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """Run a change to its end, shielded and bounded; deliver a cancellation after it."""
        self._check_open()
        await trio.lowlevel.checkpoint_if_cancelled()
        done = False
        with trio.move_on_after(_WRITE_BOUND, shield=True):
            result = await call()
            done = True
        if not done:
            raise BrokerUnavailable(
                f"the PostgreSQL run store did not finish a change within {_WRITE_BOUND:g} s"
            )
        await trio.lowlevel.checkpoint_if_cancelled()
        return result

    async def _pipeline(self, *statements: tuple[str, Sequence[Any]]) -> list[Result]:
        """Statements in one transaction, as one change, in one round trip (shared with the
        changes of other tasks queued meanwhile: see :class:`WriteBatcher`)."""
        self._check_open()
        return await self._batcher.write([(self._s(query), params) for query, params in statements])

    async def _fetch(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        self._check_open()
        return await self._pool.fetch(self._s(query), *params)

    # -- runs -------------------------------------------------------------------------------

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        now = self.now()
        insert = (sql.INSERT_RUN, insert_run_params(self._ns, run, now))
        inserted, *_ = await self._pipeline(insert, *self._tag_rows(run))
        if inserted.rowcount == 1:  # inserted as given (the common case: no read back)
            return attrs.evolve(run, created_at=now, updated_at=now), True
        # The id exists: the insert again (nothing, or the run if it is gone meanwhile), then
        # the row that won, read in the insert's transaction (see _pg_tables.py).
        inserted, *_, found = await self._pipeline(
            insert, *self._tag_rows(run), (sql.GET_RUN, (self._ns, run.run_id))
        )
        if inserted.rowcount == 1:
            return attrs.evolve(run, created_at=now, updated_at=now), True
        return _run(found.rows[0]), False

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._fetch(sql.GET_RUN, self._ns, run_id)
        return _run(rows[0]) if rows else None

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        query = f"SELECT {sql.RUN_COLUMNS} FROM {{schema}}.runs WHERE namespace = $1"
        params: list[Any] = [self._ns]
        for clause, value in (("status", status), ("workflow", workflow)):
            if value is not None:
                params.append(str(value))
                query += f" AND {clause} = ${len(params)}"
        params.append(limit)
        query += f" ORDER BY seq DESC LIMIT ${len(params)}"
        return skip_damaged(*read_listed(await self._fetch(query, *params)))

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
        tags: Mapping[str, str] | None = None,
    ) -> RunPage:
        check_page(limit, since, until, tenant)
        wanted = check_tags(tags, "page_runs: tags")
        below = decode_cursor(cursor)
        query = f"SELECT seq, {sql.RUN_COLUMNS} FROM {{schema}}.runs WHERE namespace = $1"
        params: list[Any] = [self._ns]
        # Tagged (issue 34): the first tag's index rows newest first, joined to their runs.
        c = "r." if wanted else ""
        if wanted:
            query, params = self._tagged_start(wanted)
        for clause, value in (
            (("t." if wanted else "") + "seq < ${}", below),
            (c + "status = ${}", None if status is None else status.value),
            (c + "workflow = ${}", workflow),
            (c + "created_at >= ${}::float8", since),
            (c + "created_at < ${}::float8", until),
            # the stored ids "{tenant}/...": a range of the key ('0' follows '/')
            (c + "run_id >= ${}", None if tenant is None else tenant + "/"),
            (c + "run_id < ${}", None if tenant is None else tenant + "0"),
        ):
            if value is not None:
                params.append(value)
                query += " AND " + clause.format(len(params))
        params.append(limit + 1)
        order = "t.seq" if wanted else "seq"
        query += f" ORDER BY {order} DESC LIMIT ${len(params)}"
        rows = await self._fetch(query, *params)
        runs, damaged = read_listed([row[1:] for row in rows[:limit]])
        more = len(rows) > limit
        return RunPage(runs, encode_cursor(int(rows[limit - 1][0])) if more else None, damaged)

    async def count_runs(self) -> dict[RunStatus, int]:
        rows = await self._fetch(sql.COUNT_RUNS, self._ns)
        return {RunStatus(status): int(n) for status, n in rows}

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        now, ns = self.now(), self._ns

        async def reopen() -> bool:
            async with self._pool.transaction() as conn:
                status = await conn.fetchval(self._s(sql.RUN_STATUS_FOR_UPDATE), ns, run_id)
                if status not in (RunStatus.FAILED.value, RunStatus.BLOCKED.value):
                    return False
                statements: list[tuple[str | bytes, Sequence[Any]]] = [
                    (self._s(sql.REOPEN_RUN), (ns, run_id, run_timeout, now))
                ]
                if status == RunStatus.FAILED.value:  # a stale mark of its previous life
                    statements.append((self._s(sql.DROP_MARK), (ns, run_id)))
                statements += [
                    (self._s(sql.REOPEN_STEP),
                     (ns, run_id, s.step_id, s.status.value, s.attempt, dumps(s.error),
                      dumps(s.retry), s.wake_at, s.dispatched, now, dumps(s.attempts)))
                    for s in steps
                ]  # fmt: skip
                await conn.pipeline(statements)
                return True

        return await self._write(reopen)

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        now = self.now()
        query = self._s(sql.CLAIM)
        rows = await self._write(
            lambda: self._pool.fetch(query, self._ns, owner, now + lease, now, include_own, limit)
        )
        runs, damaged = read_claims([row[1:] for row in sorted(rows, key=lambda r: int(r[0]))])
        if damaged:  # set aside: failed, never driven (they hold no other run up)
            ended = [
                ((sql.FINISH, (self._ns, run_id, RunStatus.FAILED.value, "null",
                               set_aside_error(exc), now)),
                 (sql.DROP_MARK_IF_ENDED, (self._ns, run_id)))
                for run_id, exc in damaged
            ]  # fmt: skip
            await self._pipeline(*[statement for pair in ended for statement in pair])
        return runs

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return set()
        query, until = self._s(sql.RENEW), self.now() + lease
        ids = sorted(set(run_ids))
        rows = await self._write(lambda: self._pool.fetch(query, self._ns, ids, owner, until))
        return {str(row[0]) for row in rows}

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return
        query, now = self._s(sql.RELEASE), self.now()
        ids = sorted(set(run_ids))
        await self._write(lambda: self._pool.execute(query, self._ns, ids, owner, now))

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        (finished,) = await self._pipeline(
            (sql.FINISH_CALL,
             (self._ns, run_id, status.value, dumps(output), dumps(error), self.now())),
        )  # fmt: skip
        return bool(finished.rows[0][0])

    # -- checkpoints ------------------------------------------------------------------------

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        return [_step(row) for row in await self._fetch(sql.GET_STEPS, self._ns, run_id)]

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        rows = await self._fetch(sql.GET_STEP, self._ns, run_id, step_id)
        return _step(rows[0]) if rows else None

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        if not keys:
            await trio.lowlevel.checkpoint()
            return []
        rows = await self._fetch(
            sql.GET_STEPS_MANY, self._ns, [k[0] for k in keys], [k[1] for k in keys]
        )
        found = {(str(row[0]), str(row[1])): _step(row) for row in rows}
        return [found.get((run_id, step_id)) for run_id, step_id in keys]

    def _step_values(self, step: StepRecord, now: float) -> tuple[Any, ...]:
        position = int(step.step_id) if step.step_id.isdigit() else 0
        return (self._ns, position, step.run_id, step.step_id, step.kind.value, step.name,
                step.status.value, step.attempt, dumps(step.input), dumps(step.output),
                dumps(step.error), dumps(step.retry), step.wake_at, step.dispatched,
                step.priority, now, step.heartbeat_timeout, _optional_dumps(step.heartbeat),
                dumps(step.attempts))  # fmt: skip

    async def begin_step(self, step: StepRecord) -> StepRecord:
        now = self.now()
        insert = (sql.INSERT_STEP, self._step_values(step, now))
        (inserted,) = await self._pipeline(insert)
        if inserted.rowcount == 1:  # inserted as given (the common case: no read back)
            return attrs.evolve(step, created_at=now, updated_at=now)
        # It exists (a replay): the insert again, then the row that won, in one transaction.
        inserted, found = await self._pipeline(
            insert, (sql.GET_STEP, (self._ns, step.run_id, step.step_id))
        )
        if inserted.rowcount == 1:
            return attrs.evolve(step, created_at=now, updated_at=now)
        return _step(found.rows[0])

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        now = self.now()
        statements: list[tuple[str, Sequence[Any]]] = [
            (sql.RUN_STATUS_FOR_SHARE, (self._ns, step.run_id)),
            (sql.INSERT_STEP_GUARDED, self._step_values(step, now)),
        ]
        found: list[Result] = []
        for read_back in (False, True):  # the row that won read back only if it exists
            if read_back:
                statements.append((sql.GET_STEP, (self._ns, step.run_id, step.step_id)))
            locked, inserted, *found = await self._pipeline(*statements)
            if not locked.rows or RunStatus(locked.rows[0][0]).terminal:
                return None  # unknown or finished: nothing was written
            if inserted.rowcount == 1:
                return attrs.evolve(step, created_at=now, updated_at=now)
        return _step(found[0].rows[0])

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        # The run locked, the compare-and-set, the state read when nothing was written: one
        # call (migration 9's function), answering the Applied value.
        (result,) = await self._pipeline(
            (sql.UPDATE_STEP_CALL,
             (self._ns, step.run_id, step.step_id, step.status.value, step.attempt,
              dumps(step.output), dumps(step.error), step.wake_at, step.dispatched, self.now(),
              _optional_dumps(step.heartbeat), dumps(step.attempts), expect_attempt)),
        )  # fmt: skip
        return Applied(result.rows[0][0])

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        (result,) = await self._pipeline(
            (sql.MARK_DISPATCHED, (self._ns, run_id, step_id, attempt))
        )
        return result.rowcount == 1

    # -- schedules --------------------------------------------------------------------------

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        query = self._s(sql.PUT_SCHEDULE if replace else sql.ADD_SCHEDULE)
        result = await self._write(lambda: self._pool.execute(query, self._ns, name, spec))
        return replace or result.rowcount == 1

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        rows = await self._fetch(sql.GET_SCHEDULES, self._ns)
        return [(str(n), str(s), None if t is None else float(t)) for n, s, t in rows]

    async def delete_schedule(self, name: str) -> bool:
        query = self._s(sql.DELETE_SCHEDULE)
        result = await self._write(lambda: self._pool.execute(query, self._ns, name))
        return result.rowcount == 1

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        query = self._s(sql.MARK_SCHEDULE_TICK)
        await self._write(lambda: self._pool.execute(query, self._ns, name, float(tick)))

    async def get_schedule_states(self) -> dict[str, str]:
        rows = await self._fetch(sql.GET_SCHEDULE_STATES, self._ns)
        return {str(n): str(state) for n, state in rows}

    async def put_schedule_state(self, name: str, state: str) -> None:
        query = self._s(sql.PUT_SCHEDULE_STATE)
        await self._write(lambda: self._pool.execute(query, self._ns, name, state))

    # -- signals and events (issue 18) ----------------------------------------------------

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        _, appended, _ = await self._pipeline(
            (sql.RUN_STATUS_FOR_UPDATE, (self._ns, run_id)),
            (sql.APPEND_SIGNAL, (self._ns, run_id, name, payload)),
            (sql.NOTIFY_IF_UNFINISHED, (self._ns, run_id, self._channel, wake_payload(run_id))),
        )
        if not appended.rows:
            return None
        self.wakes.wake((run_id,))
        return int(appended.rows[0][0])

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        rows = await self._fetch(sql.READ_SIGNAL, self._ns, run_id, name, seq)
        return str(rows[0][0]) if rows else None

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await self._pipeline(
            (sql.PUT_EVENT, (self._ns, run_id, key, value)),
            (sql.NOTIFY, (self._channel, wake_payload(run_id))),
        )
        self.wakes.wake((run_id,))

    async def get_events(self, run_id: str) -> dict[str, str]:
        rows = await self._fetch(sql.GET_EVENTS, self._ns, run_id)
        return {str(k): str(v) for k, v in rows}

    # -- dedup and debounce keys (issue 33, item 4: _pg_starts.py) ---------------------------

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        now, ns = self.now(), self._ns

        async def dedup() -> tuple[RunRecord, bool]:
            async with self._pool.transaction() as conn:
                await conn.execute(self._s(starts.INSERT_DEDUP_KEY), ns, key, run.run_id)
                holder = await conn.fetchval(self._s(starts.DEDUP_KEY_FOR_UPDATE), ns, key)
                if holder != run.run_id:
                    rows = await conn.fetch(self._s(sql.GET_RUN), ns, holder)
                    last = _run(rows[0]) if rows else None
                    if last is not None and not last.status.terminal:
                        return last, False
                    await conn.execute(self._s(starts.SET_DEDUP_KEY), ns, key, run.run_id)
                inserted = await conn.execute(
                    self._s(sql.INSERT_RUN), *insert_run_params(ns, run, now)
                )
                if inserted.rowcount == 1:
                    for query, params in self._tag_rows(run):  # (its tags' index rows)
                        await conn.execute(self._s(query), *params)
                    return attrs.evolve(run, created_at=now, updated_at=now), True
                rows = await conn.fetch(self._s(sql.GET_RUN), ns, run.run_id)
                return _run(rows[0]), False

        return await self._write(dedup)

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        now, query = self.now(), self._s(starts.DEBOUNCE)
        params = debounce_params(self._ns, key, run, now, delay, max_wait)
        rows = await self._write(lambda: self._pool.fetch(query, *params))
        return str(rows[0][0])

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        now, ns = self.now(), self._ns

        async def start() -> tuple[list[RunRecord], float | None]:
            async with self._pool.transaction() as conn:
                due = await conn.fetch(self._s(starts.TAKE_DUE), ns, now, limit)
                created: list[RunRecord] = []
                for run_id, workflow, text, timeout, trace, _, tags in sorted(
                    due, key=lambda r: r[5]
                ):
                    inserted = await conn.execute(
                        self._s(starts.INSERT_STARTED), ns, run_id, workflow, text, now, timeout,
                        trace, tags,
                    )  # fmt: skip
                    if inserted.rowcount == 1:
                        value, readable = started_input(run_id, text)
                        run = RunRecord(
                            run_id, workflow, value, RunStatus.PENDING, now, now,
                            timeout=timeout, trace=read_trace(trace), tags=read_tags(tags),
                        )  # fmt: skip
                        for query, params in self._tag_rows(run):  # (its tags' index rows)
                            await conn.execute(self._s(query), *params)
                        if readable:  # (else its claim sets it aside)
                            created.append(run)
                soonest = await conn.fetchval(self._s(starts.SOONEST_DEBOUNCED), ns)
                return created, None if soonest is None else float(soonest)

        return await self._write(start)

    async def debounced_due(self, run_id: str) -> float | None:
        rows = await self._fetch(starts.DEBOUNCED_DUE, self._ns, run_id)
        if not rows:
            return None
        due = float(rows[0][0])
        return due if due == due else 0.0  # (NaN: damaged, due now, as ``TAKE_DUE`` takes it)

    # -- run tags (issue 34) ----------------------------------------------------------------

    def _tag_rows(self, run: RunRecord) -> list[tuple[str, Sequence[Any]]]:
        """The statement that indexes ``run``'s tags, in its create's transaction (none for a
        run without tags)."""
        if not run.tags:
            return []
        return [(sql.INSERT_RUN_TAGS, tag_rows_params(self._ns, run))]

    def _tagged_start(self, tags: dict[str, str]) -> tuple[str, list[Any]]:
        """The start of a tagged page's query (see ``_sqlite_tables.tagged_filters``)."""
        where, params = tagged_filters(tags, numbered=True)
        columns = ", ".join("r." + c.strip() for c in sql.RUN_COLUMNS.split(","))
        query = (
            f"SELECT t.seq, {columns} FROM {{schema}}.run_tags AS t"
            " JOIN {schema}.runs AS r"
            " ON r.namespace = t.namespace AND r.run_id = t.run_id AND r.seq = t.seq"
            " WHERE t.namespace = $1 AND " + where.replace("{tags}", "{schema}.run_tags")
        )
        return query, [self._ns, *params]

    # -- retention (issue 34) ---------------------------------------------------------------

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        query = self._s(sql.PRUNE_FINISHED if workflow is None else sql.PRUNE_FINISHED_OF)
        rows = await self._write(
            lambda: self._pool.fetch(query, self._ns, float(ended_before), workflow, limit)
        )
        return [str(row[0]) for row in rows]

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        rows = await self._fetch(sql.COUNT_FINISHED, self._ns, float(ended_before), workflow)
        return int(rows[0][0])

    async def finished_workflows(self) -> list[str]:
        return sorted(str(row[0]) for row in await self._fetch(sql.FINISHED_WORKFLOWS, self._ns))


class PostgresRunStores:
    """Run stores on one pool, their tables in one schema (migrated once, on first use).

    Args:
        pool: the pool (the caller's: never closed here).
        schema: the PostgreSQL schema of the tables.
        hub: where the stores hear other processes' wakes (``None``: their waiters poll).
    """

    def __init__(
        self, pool: PgPool, schema: str = "durable_trio", *, hub: NotifyHub | None = None
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.hub = hub
        self._migrated = False

    async def _migrate(self) -> None:
        if not self._migrated:
            await migrate(self.pool, self.schema, "runs", sql.RUNS_MIGRATIONS)
            self._migrated = True

    @asynccontextmanager
    async def open(self, namespace: str) -> AsyncIterator[PostgresRunStore]:
        """A store for ``namespace``; closed on leaving (the pool is not).

        Raises:
            BrokerUnavailable: the server cannot be reached.
            BrokerError: the migrations failed, or the schema is newer than this code.
        """
        await self._migrate()
        store = PostgresRunStore(self.pool, self.schema, namespace, hub=self.hub)
        try:
            yield store
        finally:
            with trio.CancelScope(shield=True):
                await store.aclose()

    async def namespaces(self) -> list[str]:
        """The namespaces with a run or a schedule in the schema, sorted."""
        await self._migrate()
        rows = await self.pool.fetch(sql.NAMESPACES.replace("{schema}", quote_ident(self.schema)))
        return [str(row[0]) for row in rows]
