"""The SQLite run store: two tables (``dt_runs``, ``dt_steps``) in the backend's database file.

It shares the broker's dedicated connection thread (see
:class:`~durable_trio._sqlite.ConnectionThread`) when given the broker, or opens its own
on a path. Clock: ``time.time()``, which every process on the machine shares. Its tables and
the SQL of each change are in ``_sqlite_tables.py``; this module is the store itself: the
group commit, the wakes, the calls.

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
import outcome
import trio

from ..._errors import BrokerError, BrokerUnavailable
from ..._sqlite import ConnectionThread, Doorbell, Synchronous, open_connection, translate_error
from .._tags import check_tags
from . import _sqlite_starts as starts
from . import _sqlite_tables as tables
from ._paging import check_page, decode_cursor
from ._wakes import RunWakes

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping, Sequence

    from ...brokers.sqlite import SqliteBroker
    from .._records import (
        Applied,
        RunPage,
        RunRecord,
        RunStatus,
        StepRecord,
    )

__all__ = ["SqliteRunStore", "stored_namespaces"]

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
            if connection.read_only is None:  # (read-only: the file is read as it is)
                await connection.call(tables.create_schema, write=True)
                await connection.call(starts.create_schema, write=True)
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
            partial(tables.create_run, self._ns, run, self.now())
        )
        return result

    async def get_run(self, run_id: str) -> RunRecord | None:
        result: RunRecord | None = await self._read(partial(tables.get_run, self._ns, run_id))
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
            partial(tables.list_runs, self._ns, status_name, workflow, limit)
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
        tags: Mapping[str, str] | None = None,
    ) -> RunPage:
        check_page(limit, since, until, tenant)
        wanted = check_tags(tags, "page_runs: tags")
        below = decode_cursor(cursor)
        filters = (None if status is None else status.value, workflow, tenant, since, until)
        result: RunPage = await self._read(
            partial(tables.page_runs, self._ns, filters, limit, below, tags=wanted)
        )
        return result

    async def count_runs(self) -> dict[RunStatus, int]:
        result: dict[RunStatus, int] = await self._read(partial(tables.count_runs, self._ns))
        return result

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        result: bool = await self._write(
            partial(tables.reopen, self._ns, run_id, tuple(steps), run_timeout, self.now())
        )
        return result

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        result: list[RunRecord] = await self._write(
            partial(tables.claim, self._ns, owner, lease, include_own, limit, self.now())
        )
        return result

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return set()
        result: set[str] = await self._write(
            partial(tables.renew, self._ns, owner, tuple(run_ids), lease, self.now())
        )
        return result

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return
        await self._write(partial(tables.release, self._ns, owner, tuple(run_ids), self.now()))

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        op = partial(
            tables.finish,
            self._ns,
            run_id,
            status.value,
            tables.dumps(output),
            tables.dumps(error),
            self.now(),
        )
        result: bool = await self._write(op)
        return result

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        result: list[StepRecord] = await self._read(partial(tables.get_steps, self._ns, run_id))
        return result

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        (found,) = await self.get_steps_many([(run_id, step_id)])
        return found

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        result: list[StepRecord | None] = await self._read(
            partial(tables.get_steps_many, self._ns, tuple(keys))
        )
        return result

    async def begin_step(self, step: StepRecord) -> StepRecord:
        result: StepRecord = await self._write(
            partial(tables.begin_step, self._ns, step, self.now())
        )
        return result

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        result: StepRecord | None = await self._write(
            partial(tables.begin_step_unless_finished, self._ns, step, self.now())
        )
        return result

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        result: Applied = await self._write(
            partial(tables.update_step, self._ns, step, expect_attempt, self.now())
        )
        return result

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        result: bool = await self._write(
            partial(tables.mark_dispatched, self._ns, run_id, step_id, attempt)
        )
        return result

    # -- schedules --------------------------------------------------------------------------

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        written: bool = await self._write(
            partial(tables.put_schedule, self._ns, name, spec, replace)
        )
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
        await self._write(partial(tables.mark_schedule_tick, self._ns, name, tick))

    async def get_schedule_states(self) -> dict[str, str]:
        ns = self._ns

        def read(db: sqlite3.Connection) -> dict[str, str]:
            rows = db.execute(
                "SELECT name, state FROM dt_schedules WHERE namespace = ? AND state IS NOT NULL",
                (ns,),
            )
            return {str(n): str(st) for n, st in rows}

        states: dict[str, str] = await self._read(read)
        return states

    async def put_schedule_state(self, name: str, state: str) -> None:
        await self._write(partial(tables.put_schedule_state, self._ns, name, state))

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
            partial(tables.append_signal, self._ns, run_id, name, payload)
        )
        if result is not None:
            self._ring(run_id)
        return result

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        result: str | None = await self._read(
            partial(tables.read_signal, self._ns, run_id, name, seq)
        )
        return result

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await self._write(partial(tables.put_event, self._ns, run_id, key, value))
        self._ring(run_id)

    async def get_events(self, run_id: str) -> dict[str, str]:
        result: dict[str, str] = await self._read(partial(tables.get_events, self._ns, run_id))
        return result

    # -- retention (issue 34) ---------------------------------------------------------------

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        result: list[str] = await self._write(
            partial(tables.prune_finished, self._ns, ended_before, workflow, limit)
        )
        return result

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        result: int = await self._read(
            partial(tables.count_finished, self._ns, ended_before, workflow)
        )
        return result

    async def finished_workflows(self) -> list[str]:
        result: list[str] = await self._read(partial(tables.finished_workflows, self._ns))
        return result


    # -- dedup and debounce keys (issue 33, item 4) -----------------------------------------

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        result: tuple[RunRecord, bool] = await self._write(
            partial(starts.create_run_deduped, self._ns, run, key, self.now())
        )
        return result

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        result: str = await self._write(
            partial(starts.debounce_run, self._ns, key, run, delay, max_wait, self.now())
        )
        return result

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        result: tuple[list[RunRecord], float | None] = await self._write(
            partial(starts.start_debounced, self._ns, limit, self.now())
        )
        return result

    async def debounced_due(self, run_id: str) -> float | None:
        result: float | None = await self._read(
            partial(starts.debounced_due, self._ns, run_id)
        )
        return result


async def stored_namespaces(broker: SqliteBroker) -> list[str]:
    """The namespaces with a run or a schedule in ``broker``'s file, sorted.

    Raises:
        BrokerUnavailable: the broker is closed or the file cannot be read.
    """
    if broker.closed:
        raise BrokerUnavailable(f"the SQLite broker on {broker.path!r} is closed")
    return await broker.connection.call(tables.namespaces, write=False)
