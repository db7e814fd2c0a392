"""A run's previous generations (continue-as-new, issue 34, item 5), on every run store.

``continue_run`` is one atomic change (one SQLite transaction, one PostgreSQL transaction, one
Redis script, no checkpoint in between in memory): if the run exists unfinished and its
current generation is the one before ``mark``'s, its history (every checkpoint, its marks
included) is moved to its previous generation of that number, the new generation's ``mark``
becomes its whole history and its input becomes ``input``. A crash leaves the run before or
after the change, never in between. Previous generations are read back with
``get_generation`` and deleted with the run (``prune_finished``).

The stores' classes are not touched (``RedisRunStore`` is at the class size limit): this
module reaches into them. PostgreSQL and Redis: ``_pg_generations.py``,
``_redis_generations.py``.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson
import trio

from .._generations import CONTINUE_STEP_ID, current_generation, expected_generation
from .._records import RunStatus, step_position

if TYPE_CHECKING:
    import sqlite3

    from .._records import StepRecord

__all__ = ["Generations", "MemoryGenerations", "generations_of"]


class Generations(Protocol):
    """A store's previous generations (see the module docstring)."""

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        """The atomic change of the module docstring. Returns whether it was made (``False``:
        the run is unknown, finished, or already in ``mark``'s generation or later)."""
        ...

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        """Previous generation ``generation``'s history, in step order (``None``: none)."""
        ...

    async def list_generations(self, run_id: str) -> list[int]:
        """The numbers of the run's previous generations, ascending."""
        ...

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        """Delete up to ``limit`` previous generations (of any run, finished or not) that ended
        before ``ended_before`` (store clock), oldest end first, each whole or gone; of runs of
        ``workflow`` only if given. Returns how many were deleted. A generation's end is the
        time the next generation's mark was made (``continue_run``'s ``now``)."""
        ...

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        """How many previous generations :meth:`prune_generations` would delete (no limit)."""
        ...

    async def generation_workflows(self) -> list[str]:
        """The workflows of the runs that have a previous generation, sorted."""
        ...


def generations_of(store: Any) -> Generations:
    """The :class:`Generations` of run store ``store``.

    Raises:
        TypeError: a store that keeps no generations (its own ``generations`` attribute, or
            one of the package's stores).
    """
    own = getattr(store, "generations", None)
    if own is not None:
        return own  # type: ignore[no-any-return]
    from .memory import MemoryRunStore
    from .sqlite import SqliteRunStore

    if isinstance(store, MemoryRunStore):
        return MemoryGenerations(store)
    if isinstance(store, SqliteRunStore):
        return _SQLiteGenerations(store)
    from .postgres import PostgresRunStore

    if isinstance(store, PostgresRunStore):
        from ._pg_generations import PostgresGenerations

        return PostgresGenerations(store)
    from .redis import RedisRunStore

    if isinstance(store, RedisRunStore):
        from ._redis_generations import RedisGenerations

        return RedisGenerations(store)
    raise TypeError(f"the run store {type(store).__name__} keeps no generations")


# -- memory -------------------------------------------------------------------------------------


class MemoryGenerations:
    """:class:`Generations` of a :class:`~.memory.MemoryRunStore` (its runs' own fields)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._store._runs.get(run_id)
        if run is None or run.status.terminal:
            return False
        held = run.steps.get(CONTINUE_STEP_ID)
        now = self._store.now()
        current = 0 if held is None else current_generation(held.input)
        if current != expected_generation(mark):
            return False
        # No checkpoint from here on: atomic.
        run.generations[current] = run.steps
        run.generation_ends[current] = now
        run.steps = {}
        run.input = orjson.dumps(input)
        run.updated_at = now
        _memory_begin(self._store, mark, now)
        return True

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._store._runs.get(run_id)
        steps = None if run is None else run.generations.get(generation)
        if steps is None:
            return None
        return [s.out() for s in sorted(steps.values(), key=lambda s: step_position(s.step_id))]

    async def list_generations(self, run_id: str) -> list[int]:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._store._runs.get(run_id)
        return [] if run is None else sorted(run.generations)

    def _prunable(self, ended_before: float, workflow: str | None) -> list[tuple[float, str, int]]:
        return sorted(
            (ended, run.run_id, g)
            for run in self._store._runs.values()
            if workflow is None or run.workflow == workflow
            for g, ended in run.generation_ends.items()
            if ended < ended_before
        )

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        doomed = self._prunable(ended_before, workflow)[:limit]
        for _, run_id, g in doomed:  # no checkpoint in between: atomic
            run = self._store._runs[run_id]
            run.generations.pop(g, None)
            del run.generation_ends[g]
        return len(doomed)

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        return len(self._prunable(ended_before, workflow))

    async def generation_workflows(self) -> list[str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        return sorted({r.workflow for r in self._store._runs.values() if r.generation_ends})


def _memory_begin(store: Any, mark: StepRecord, now: float) -> None:
    """``store.begin_step(mark)`` without its checkpoint (inside an atomic change)."""
    from .memory import _Step

    dumps = orjson.dumps
    store._runs[mark.run_id].steps[mark.step_id] = _Step(
        run_id=mark.run_id, step_id=mark.step_id, kind=mark.kind, name=mark.name,
        status=mark.status, attempt=mark.attempt, input=dumps(mark.input),
        output=dumps(mark.output), error=dumps(mark.error), retry=dumps(mark.retry),
        wake_at=mark.wake_at, dispatched=mark.dispatched, priority=mark.priority,
        created_at=now, updated_at=now,
    )  # fmt: skip


# -- SQLite -------------------------------------------------------------------------------------

_COPY_COLUMNS: Final = (
    "step_id, position, kind, name, status, attempt, input, output, error, retry, wake_at, "
    "dispatched, priority, created_at, updated_at, heartbeat_timeout, heartbeat, attempts"
)


def _sqlite_continue(
    ns: str, run_id: str, mark: StepRecord, input_: str, now: float, db: sqlite3.Connection
) -> bool:
    from . import _sqlite_tables as tables

    row = db.execute(
        "SELECT status FROM dt_runs WHERE namespace = ?1 AND run_id = ?2", (ns, run_id)
    ).fetchone()
    if row is None or RunStatus(row[0]).terminal:
        return False
    held = db.execute(
        "SELECT input FROM dt_steps WHERE namespace = ?1 AND run_id = ?2 AND step_id = ?3",
        (ns, run_id, CONTINUE_STEP_ID),
    ).fetchone()
    current = current_generation(None if held is None else held[0])
    if current != expected_generation(mark):
        return False
    db.execute(
        f"INSERT OR REPLACE INTO dt_generations (namespace, run_id, generation, {_COPY_COLUMNS}) "
        f"SELECT namespace, run_id, ?3, {_COPY_COLUMNS} FROM dt_steps "
        "WHERE namespace = ?1 AND run_id = ?2",
        (ns, run_id, current),
    )
    db.execute(
        "INSERT OR REPLACE INTO dt_generation_ends (namespace, run_id, generation, workflow, "
        "ended_at) SELECT namespace, run_id, ?3, workflow, ?4 FROM dt_runs "
        "WHERE namespace = ?1 AND run_id = ?2",
        (ns, run_id, current, now),
    )
    db.execute("DELETE FROM dt_steps WHERE namespace = ?1 AND run_id = ?2", (ns, run_id))
    tables.begin_step(ns, mark, now, db)
    db.execute(
        "UPDATE dt_runs SET input = ?3, updated_at = ?4 WHERE namespace = ?1 AND run_id = ?2",
        (ns, run_id, input_, now),
    )
    return True


def _sqlite_generation(
    ns: str, run_id: str, generation: int, db: sqlite3.Connection
) -> list[StepRecord] | None:
    from . import _sqlite_tables as tables

    rows = db.execute(
        f"SELECT {tables._STEP_COLUMNS} FROM dt_generations "
        "WHERE namespace = ?1 AND run_id = ?2 AND generation = ?3 ORDER BY position, step_id",
        (ns, run_id, generation),
    ).fetchall()
    return [tables._step(row) for row in rows] if rows else None


def _sqlite_list(ns: str, run_id: str, db: sqlite3.Connection) -> list[int]:
    rows = db.execute(
        "SELECT DISTINCT generation FROM dt_generations WHERE namespace = ?1 AND run_id = ?2 "
        "ORDER BY generation",
        (ns, run_id),
    )
    return [int(row[0]) for row in rows]


_PRUNABLE_GENERATIONS: Final = (
    "FROM dt_generation_ends WHERE namespace = ?1 AND ended_at < ?2 "
    "AND (?3 IS NULL OR workflow = ?3)"
)


def _sqlite_prune(
    ns: str, ended_before: float, workflow: str | None, limit: int, db: sqlite3.Connection
) -> int:
    doomed = db.execute(
        f"SELECT run_id, generation {_PRUNABLE_GENERATIONS} ORDER BY ended_at LIMIT ?4",
        (ns, ended_before, workflow, limit),
    ).fetchall()
    for run_id, generation in doomed:  # (one transaction: each whole or gone)
        for table in ("dt_generations", "dt_generation_ends"):
            db.execute(
                f"DELETE FROM {table} WHERE namespace = ?1 AND run_id = ?2 AND generation = ?3",
                (ns, run_id, generation),
            )
    return len(doomed)


def _sqlite_count(
    ns: str, ended_before: float, workflow: str | None, db: sqlite3.Connection
) -> int:
    row = db.execute(f"SELECT count(*) {_PRUNABLE_GENERATIONS}", (ns, ended_before, workflow))
    return int(row.fetchone()[0])


def _sqlite_workflows(ns: str, db: sqlite3.Connection) -> list[str]:
    rows = db.execute(
        "SELECT DISTINCT workflow FROM dt_generation_ends WHERE namespace = ?1 ORDER BY workflow",
        (ns,),
    )
    return [str(row[0]) for row in rows]


class _SQLiteGenerations:
    def __init__(self, store: Any) -> None:
        self._store = store

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        store = self._store
        text = orjson.dumps(input).decode()
        call = partial(_sqlite_continue, store._ns, run_id, mark, text, store.now())
        return bool(await store._write(call))

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        store = self._store
        call = partial(_sqlite_generation, store._ns, run_id, generation)
        result: list[StepRecord] | None = await store._read(call)
        return result

    async def list_generations(self, run_id: str) -> list[int]:
        store = self._store
        result: list[int] = await store._read(partial(_sqlite_list, store._ns, run_id))
        return result

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        store = self._store
        call = partial(_sqlite_prune, store._ns, ended_before, workflow, limit)
        return int(await store._write(call))

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        store = self._store
        return int(await store._read(partial(_sqlite_count, store._ns, ended_before, workflow)))

    async def generation_workflows(self) -> list[str]:
        store = self._store
        result: list[str] = await store._read(partial(_sqlite_workflows, store._ns))
        return result
