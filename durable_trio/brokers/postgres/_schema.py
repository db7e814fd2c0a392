"""The PostgreSQL broker's tables, as the versioned steps of the ``broker`` part
(:mod:`durable_trio._postgres._migrations`).

All in the backend's one schema; a queue (namespace included) is a column, never a table.
``broker_jobs`` holds the jobs that wait or are claimed (the hot table: a finished job's row is
deleted, a failed one moved out); its partial indexes put each row only in the index of its
state. ``broker_failed`` keeps failed jobs for inspection (bounded per queue);
``broker_quarantine`` rows whose id could not be read; ``broker_limits`` the queues' fleet-wide
concurrency limits (``SupportsQueueLimits``, step 3); ``broker_rates`` and
``broker_rate_starts`` the queues' rate limits (``SupportsRateLimits``, step 4, :mod:`._rates`).
Times are seconds since the epoch on the server's clock (``double precision``); ``seq`` orders
jobs of one priority (FIFO), one sequence for the whole schema.
"""

from __future__ import annotations

from typing import Final

from ..._postgres import Migration
from ._rates import RATE_MIGRATION, RATE_PER_KEY_MIGRATION

__all__ = ["MIGRATIONS", "PART"]

#: The part's name in ``durable_trio_schema``.
PART: Final = "broker"

_V1: Final = """
CREATE SEQUENCE {schema}.broker_seq;

CREATE TABLE {schema}.broker_jobs (
    pk bigserial PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    id text,
    data bytea,
    priority bigint NOT NULL DEFAULT 0,
    seq bigint NOT NULL DEFAULT nextval('{schema}.broker_seq'),
    state text NOT NULL CHECK (state IN ('ready', 'delayed', 'active')),
    due_at double precision,
    token text,
    claimed_at double precision,
    worker text NOT NULL DEFAULT '',
    started boolean NOT NULL DEFAULT true,
    attempts bigint NOT NULL DEFAULT 0,
    stalled_count bigint NOT NULL DEFAULT 0,
    stalls text NOT NULL DEFAULT '[]',
    note text,
    pushed_at double precision,
    CHECK ((state = 'active') = (token IS NOT NULL AND claimed_at IS NOT NULL)),
    CHECK ((state = 'delayed') = (due_at IS NOT NULL))
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05);

CREATE INDEX broker_jobs_ready ON {schema}.broker_jobs (queue, priority, seq)
    WHERE state = 'ready';
CREATE INDEX broker_jobs_delayed ON {schema}.broker_jobs (queue, due_at)
    WHERE state = 'delayed';
CREATE INDEX broker_jobs_active ON {schema}.broker_jobs (queue, claimed_at)
    WHERE state = 'active';
CREATE INDEX broker_jobs_token ON {schema}.broker_jobs (token) WHERE state = 'active';

CREATE TABLE {schema}.broker_failed (
    pk bigserial PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    id text,
    data bytea,
    priority bigint NOT NULL DEFAULT 0,
    error text,
    failed_at double precision,
    attempts bigint NOT NULL DEFAULT 0,
    stalled_count bigint NOT NULL DEFAULT 0,
    stalls text NOT NULL DEFAULT '[]',
    pushed_at double precision
);
CREATE INDEX broker_failed_queue ON {schema}.broker_failed (queue, pk);

CREATE TABLE {schema}.broker_quarantine (
    pk bigserial PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    reason text NOT NULL,
    raw bytea NOT NULL,
    at double precision NOT NULL
);
CREATE INDEX broker_quarantine_queue ON {schema}.broker_quarantine (queue, pk);
"""

#: The hot table's vacuum settings (issue 32, item 5): every claim updates a row and every
#: finish deletes one, so dead tuples pile up at the job rate. Vacuumed after 500 dead rows,
#: never throttled (the table stays small: its vacuum is cheap, and a throttled one falls
#: behind a busy queue), and pages left 20 % free so a claim's update can stay on its page.
_V2: Final = """
ALTER TABLE {schema}.broker_jobs SET (
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_insert_threshold = 1000,
    fillfactor = 80
);
"""

#: Fleet-wide concurrency limits (issue 33): each job's concurrency key (``Job.key``, ``''``:
#: none; kept by a failed job, so a requeue keeps it), one row per limited queue, and the
#: partial index a per-key limit counts its claims on. Partial on a key, so a claim of a job
#: without one (every job but a keyed step's) writes no entry there; the key ``''`` is counted
#: off ``broker_jobs_active``. The slots in use are never stored: a claim counts the live
#: claims, so a slot comes back with its lease however that ends. The columns have a constant
#: default: added without rewriting the tables.
_V3: Final = """
ALTER TABLE {schema}.broker_jobs ADD COLUMN ckey text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE {schema}.broker_failed ADD COLUMN ckey text COLLATE "C" NOT NULL DEFAULT '';
CREATE INDEX broker_jobs_active_key ON {schema}.broker_jobs (queue, ckey)
    WHERE state = 'active' AND ckey <> '';
CREATE TABLE {schema}.broker_limits (
    queue text COLLATE "C" PRIMARY KEY,
    lim bigint NOT NULL CHECK (lim >= 1),
    per_key boolean NOT NULL DEFAULT false
);
"""

#: The broker's steps, oldest first (append only: a released step never changes).
MIGRATIONS: Final = (
    Migration(1, _V1, "jobs, failed jobs, quarantine"),
    Migration(2, _V2, "the jobs table's vacuum settings"),
    Migration(3, _V3, "fleet-wide concurrency limits: the jobs' keys, the limits table"),
    Migration(4, RATE_MIGRATION, "rate limits: the rates and their logs of starts"),
    Migration(5, RATE_PER_KEY_MIGRATION, "rate limits: whether a rate holds per key"),
)
