"""The SQLite run store's table of previous generations (continue-as-new: ``_generations.py``)."""

from __future__ import annotations

from typing import Final

__all__ = ["SQLITE_GENERATIONS_SCHEMA"]

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
)
"""The previous generations' checkpoints: ``dt_steps``' columns and the generation (created
in an older file when it is opened)."""
