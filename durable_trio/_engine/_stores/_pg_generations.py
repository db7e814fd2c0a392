"""The PostgreSQL run store's previous generations (continue-as-new: see ``_generations.py``;
the tables: migrations 6 and 10 of part ``"runs"``, ``_pg_tables.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .._generations import CONTINUE_STEP_ID, current_generation, expected_generation
from .._records import RunStatus
from . import _pg_tables as sql
from ._sqlite_tables import _step, dumps

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._records import StepRecord
    from .postgres import PostgresRunStore

__all__ = ["PostgresGenerations"]

_COLUMNS: Final = (
    "step_id, position, kind, name, status, attempt, input, output, error, retry, wake_at, "
    "dispatched, priority, created_at, updated_at, heartbeat_timeout, heartbeat, attempts"
)
_MARK_INPUT: Final = """
    SELECT input FROM {schema}.run_steps WHERE namespace = $1 AND run_id = $2 AND step_id = $3
"""
_ARCHIVE: Final = f"""
    INSERT INTO {{schema}}.run_generations (namespace, run_id, generation, {_COLUMNS})
    SELECT namespace, run_id, $3::bigint, {_COLUMNS} FROM {{schema}}.run_steps
    WHERE namespace = $1 AND run_id = $2
    ON CONFLICT DO NOTHING
"""
_END: Final = """
    INSERT INTO {schema}.run_generation_ends (namespace, run_id, generation, workflow, ended_at)
    SELECT namespace, run_id, $3::bigint, workflow, $4::float8 FROM {schema}.runs
    WHERE namespace = $1 AND run_id = $2
    ON CONFLICT DO NOTHING
"""
_PRUNABLE: Final = """
    FROM {schema}.run_generation_ends
    WHERE namespace = $1 AND ended_at < $2::float8 AND ($3::text IS NULL OR workflow = $3::text)
"""
# The generations picked, locked (one another prune holds is skipped), deleted with their
# ends in one statement (each whole or gone).
_PRUNE: Final = f"""
    WITH doomed AS MATERIALIZED (
        SELECT run_id, generation {_PRUNABLE}
        ORDER BY ended_at LIMIT $4::bigint FOR UPDATE SKIP LOCKED
    ), steps AS (
        DELETE FROM {{schema}}.run_generations AS g USING doomed AS d
        WHERE g.namespace = $1 AND g.run_id = d.run_id AND g.generation = d.generation
    )
    DELETE FROM {{schema}}.run_generation_ends AS e USING doomed AS d
    WHERE e.namespace = $1 AND e.run_id = d.run_id AND e.generation = d.generation
    RETURNING e.run_id
"""
_COUNT: Final = f"SELECT count(*) {_PRUNABLE}"
_WORKFLOWS: Final = """
    SELECT DISTINCT workflow FROM {schema}.run_generation_ends WHERE namespace = $1
    ORDER BY workflow
"""
_CLEAR: Final = "DELETE FROM {schema}.run_steps WHERE namespace = $1 AND run_id = $2"
_SET_INPUT: Final = """
    UPDATE {schema}.runs SET input = $3, updated_at = $4 WHERE namespace = $1 AND run_id = $2
"""
_GET: Final = f"""
    SELECT {sql.STEP_COLUMNS} FROM {{schema}}.run_generations
    WHERE namespace = $1 AND run_id = $2 AND generation = $3 ORDER BY position, step_id
"""
_LIST: Final = """
    SELECT DISTINCT generation FROM {schema}.run_generations
    WHERE namespace = $1 AND run_id = $2 ORDER BY generation
"""


class PostgresGenerations:
    """:class:`~._generations.Generations` of a :class:`~.postgres.PostgresRunStore`."""

    def __init__(self, store: PostgresRunStore) -> None:
        self._store = store

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        store = self._store
        ns, now, s = store._ns, store.now(), store._s

        async def change() -> bool:
            async with store._pool.transaction() as conn:
                status = await conn.fetchval(s(sql.RUN_STATUS_FOR_UPDATE), ns, run_id)
                if status is None or RunStatus(status).terminal:
                    return False
                held = await conn.fetchval(s(_MARK_INPUT), ns, run_id, CONTINUE_STEP_ID)
                current = current_generation(held)
                if current != expected_generation(mark):
                    return False
                statements: list[tuple[str | bytes, Sequence[Any]]] = [
                    (s(_ARCHIVE), (ns, run_id, current)),
                    (s(_END), (ns, run_id, current, now)),
                    (s(_CLEAR), (ns, run_id)),
                    (s(sql.INSERT_STEP), store._step_values(mark, now)),
                    (s(_SET_INPUT), (ns, run_id, dumps(input), now)),
                ]
                await conn.pipeline(statements)
                return True

        return await store._write(change)

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        rows = await self._store._fetch(_GET, self._store._ns, run_id, generation)
        return [_step(row) for row in rows] if rows else None

    async def list_generations(self, run_id: str) -> list[int]:
        rows = await self._store._fetch(_LIST, self._store._ns, run_id)
        return [int(row[0]) for row in rows]

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        store = self._store
        rows = await store._write(
            lambda: store._fetch(_PRUNE, store._ns, float(ended_before), workflow, limit)
        )
        return len(rows)

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        store = self._store
        rows = await store._fetch(_COUNT, store._ns, float(ended_before), workflow)
        return int(rows[0][0])

    async def generation_workflows(self) -> list[str]:
        rows = await self._store._fetch(_WORKFLOWS, self._store._ns)
        return [str(row[0]) for row in rows]
