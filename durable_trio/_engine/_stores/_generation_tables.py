"""The SQLite run store's table of previous generations (continue-as-new: ``_generations.py``)."""

from __future__ import annotations

from typing import Final

__all__ = ["BACKFILL_ENDS", "SQLITE_GENERATIONS_SCHEMA", "backfill_ends"]

SQLITE_GENERATIONS_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS dt_generations (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        generation INTEGER NOT NULL,
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
        PRIMARY KEY (namespace, run_id, generation, step_id)
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE IF NOT EXISTS dt_generation_ends (
        namespace TEXT NOT NULL,
        run_id TEXT NOT NULL,
        generation INTEGER NOT NULL,
        workflow TEXT NOT NULL,
        ended_at REAL NOT NULL,
        PRIMARY KEY (namespace, run_id, generation)
    ) WITHOUT ROWID
    """,
    "CREATE INDEX IF NOT EXISTS dt_generation_ends_at ON dt_generation_ends (namespace, ended_at)",
    """
    CREATE INDEX IF NOT EXISTS dt_generation_ends_workflow
        ON dt_generation_ends (namespace, workflow, ended_at)
    """,
)
"""The previous generations' checkpoints: ``dt_steps``' columns and the generation (created
in an older file when it is opened), and when each previous generation ended (retention of
generations: ``dt_generation_ends``, a row per previous generation, deleted with it)."""

BACKFILL_ENDS: Final = """
    INSERT INTO {ends} (namespace, run_id, generation, workflow, ended_at)
    SELECT g.namespace, g.run_id, g.generation, r.workflow, COALESCE(
        (SELECT n.created_at FROM {gens} AS n WHERE n.namespace = g.namespace
            AND n.run_id = g.run_id AND n.generation = g.generation + 1
            AND n.step_id = 'continue:run'),
        (SELECT s.created_at FROM {steps} AS s WHERE s.namespace = g.namespace
            AND s.run_id = g.run_id AND s.step_id = 'continue:run'),
        g.ended)
    FROM (SELECT namespace, run_id, generation, max(updated_at) AS ended FROM {gens}
          GROUP BY namespace, run_id, generation) AS g
    JOIN {runs} AS r ON r.namespace = g.namespace AND r.run_id = g.run_id
    WHERE true
    ON CONFLICT DO NOTHING
"""
"""The end of each previous generation archived before the ends table existed: the time the
next generation's mark was made (else its last checkpoint's change)."""


def backfill_ends(ends: str, gens: str, steps: str, runs: str) -> str:
    """:data:`BACKFILL_ENDS` over these tables."""
    return BACKFILL_ENDS.format(ends=ends, gens=gens, steps=steps, runs=runs)
